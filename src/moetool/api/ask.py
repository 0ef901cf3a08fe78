"""``ask``: questions put to a finished model in transformers and to its GGUFs in llama.cpp, side by side."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moetool.eval.answers import Answer
from moetool.eval.answers import ask as ask_transformers
from moetool.export.greedy import common_prefix
from moetool.io.jsontypes import JsonObject
from moetool.io.sources import resolve_source

__all__ = ["AskedQuestion", "GgufAnswer", "ask"]


@dataclass
class GgufAnswer:
    """A GGUF's greedy answer to the same chat-templated ids.

    ``same_prefix``: how many of its first tokens equal transformers' answer (``matches``: all of them, and the
    same length).
    """

    text: str
    ids: list[int]
    same_prefix: int
    matches: bool
    tokens_per_s: float

    def to_json(self) -> JsonObject:
        """The answer as ``answers.json`` holds it."""
        return {
            "answer": self.text,
            "tokens": len(self.ids),
            "same_prefix_tokens": self.same_prefix,
            "matches_transformers": self.matches,
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


@dataclass
class AskedQuestion:
    """One question: the transformers answer (with its expert shares) and each GGUF's, by artifact name."""

    answer: Answer
    gguf: dict[str, GgufAnswer] = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        """The question's answers (transformers, then each GGUF) as ``answers.json`` holds them."""
        return self.answer.to_json() | {"gguf": {k: v.to_json() for k, v in self.gguf.items()}}


def ask(
    model: str | Path,
    questions: dict[str, str],
    *,
    ggufs: dict[str, Path] | None = None,
    max_new_tokens: int = 48,
) -> list[AskedQuestion]:
    """Ask each question (label → text) as a user turn of the model's chat template.

    Returns the greedy answer of the model in transformers with the expert shares that produced it, and of each
    GGUF (name → file) in llama.cpp, which gets the same prompt ids (so the tokenizer is not what differs).

    Raises:
        MoetoolError: the model's tokenizer has no chat template.
        MissingExtraError: a GGUF is given and llama-cpp-python is not installed.
    """
    from transformers import AutoTokenizer

    if not questions:
        return []
    path = resolve_source(str(model)).path
    answers = [AskedQuestion(a) for a in ask_transformers(path, questions, max_new_tokens=max_new_tokens)]
    if not ggufs:
        return answers
    from moetool.export.gguf.generate import GgufGenerator

    tok = AutoTokenizer.from_pretrained(str(path))
    stop = answers[0].answer.stop_ids
    n_ctx = max(len(q.answer.prompt_ids) for q in answers) + max_new_tokens + 8
    for name, file in ggufs.items():
        gen = GgufGenerator(file, n_ctx=n_ctx)
        try:
            for q in answers:
                ids, speed = gen.greedy(q.answer.prompt_ids, max_new_tokens, stop)
                same = common_prefix(ids, q.answer.ids)
                matches = same == len(ids) == len(q.answer.ids)
                text = str(tok.decode(ids, skip_special_tokens=True)).strip()
                q.gguf[name] = GgufAnswer(text, ids, same, matches, speed)
        finally:
            gen.close()
    return answers
