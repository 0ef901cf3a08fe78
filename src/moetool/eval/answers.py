"""Ask a model questions through its chat template: the greedy answer and, for an MoE, which experts produced it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moetool.arch.outputs import expert_count
from moetool.errors import MoetoolError
from moetool.eval.perplexity import load_causal_lm
from moetool.eval.report import expert_names
from moetool.io.jsontypes import JsonObject
from moetool.routing.tap import RouterTap, has_moe_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["Answer", "answer_shares", "ask", "chat_prompt_ids"]


@dataclass
class Answer:
    """One question's greedy answer.

    ``prompt_ids``: the chat-templated question; ``ids``: the answer's tokens (EOS excluded); ``shares``: expert name →
    share of the top-k routing choices made while producing the answer (every layer, every answer token; empty for a
    dense model); ``tokens_per_s``: generation speed; ``stop_ids``: the tokens that end an answer.
    """

    label: str
    question: str
    text: str
    prompt_ids: list[int]
    ids: list[int]
    shares: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    stop_ids: list[int] = field(default_factory=list)

    def to_json(self) -> JsonObject:
        return {
            "label": self.label,
            "question": self.question,
            "answer": self.text,
            "tokens": len(self.ids),
            "expert_shares": dict(self.shares),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """``question`` as one user turn of the tokenizer's chat template, ready for the assistant's reply.

    Raises:
        MoetoolError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise MoetoolError("the model's tokenizer has no chat template: questions are asked as chat turns")
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # a BatchEncoding (a Mapping) where a tokenizer gives one in spite of return_dict=False
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    tokens = [i for i in ids if isinstance(i, int)]
    if isinstance(ids, str) or len(tokens) != len(ids):  # text, or one list per conversation: not one prompt's ids
        raise MoetoolError(
            f"the tokenizer's chat template gave a {type(ids).__name__}, not the token ids of one question"
        )
    return tokens


def _expert_names(path: Path, n: int) -> list[str]:
    names = expert_names(path)
    return names if names is not None and len(names) == n else [f"expert{i}" for i in range(n)]


def answer_shares(model: PreTrainedModel, prompt_ids: list[int], ids: list[int], names: list[str]) -> dict[str, float]:
    """Expert name → share of the routing choices at the positions that predicted ``ids`` (one forward pass)."""
    tap = RouterTap(model)
    try:
        with torch.no_grad():
            model(torch.tensor([prompt_ids + ids[:-1]]) if ids else torch.tensor([prompt_ids]))
    finally:
        tap.remove()
    k = int(model.config.num_experts_per_tok)
    counts = torch.zeros(len(names))
    start = len(prompt_ids) - 1
    for logits in tap.logits:  # [T, E] per layer
        chosen = logits.float()[start:].topk(k, dim=-1).indices.flatten()
        counts += torch.bincount(chosen, minlength=len(names))[: len(names)].float()
    total = float(counts.sum()) or 1.0
    return {name: round(float(c) / total, 4) for name, c in zip(names, counts, strict=True)}


def ask(path: str | Path, questions: dict[str, str], *, max_new_tokens: int = 48) -> list[Answer]:
    """Each question's greedy answer from the model at ``path`` (transformers, float32), with its expert shares."""
    path = Path(path)
    from transformers import GenerationMixin

    model, tok = load_causal_lm(path)
    if not isinstance(model, GenerationMixin):
        raise MoetoolError(f"{path}: {type(model).__name__} does not generate text: questions need a causal LM")
    moe = has_moe_layers(model)
    names = _expert_names(path, expert_count(model.config.to_dict())) if moe else []
    stop = _stop_ids(model, tok)
    answers = []
    for label, question in questions.items():
        prompt = chat_prompt_ids(tok, question)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=stop[0] if stop else None,
            )
        seconds = time.perf_counter() - start
        ids = [int(i) for i in out[0, len(prompt) :]]
        while ids and ids[-1] in stop:
            ids.pop()
        shares = answer_shares(model, prompt, ids, names) if moe else {}
        text = str(tok.decode(ids, skip_special_tokens=True)).strip()
        answers.append(Answer(label, question, text, prompt, ids, shares, len(ids) / max(seconds, 1e-9), stop))
    return answers


def _stop_ids(model: PreTrainedModel, tok: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids of the generation config and the tokenizer (ChatML's ``<|im_end|>`` among them)."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tok.eos_token_id):
        for i in value if isinstance(value, list) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids
