"""What a mofe recipe can be checked for with the base's tokenizer and config but no weights: prompts that tokenize
to nothing, prompts longer than the base's context, ``chat_template: true`` without a template.

Run by ``moetool validate`` (when the base resolves locally) and at the start of every plan, so a bad prompt fails in
a second rather than after minutes of router computation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from pathlib import Path

from moetool.errors import PreflightError
from moetool.io.safe import read_json
from moetool.recipe.mofe import MoFERecipe
from moetool.routing.init import encode_prompts


def _prompt_fields(recipe: MoFERecipe) -> list[tuple[str, str]]:
    """(field path, prompt) for every prompt the router initialisation reads."""
    out = []
    for i, e in enumerate(recipe.experts):
        for kind in ("positive_prompts", "negative_prompts"):
            out += [(f"experts.{i}.{kind}.{j}", p) for j, p in enumerate(getattr(e, kind))]
    if recipe.shared_expert is not None:
        for kind in ("positive_prompts", "negative_prompts"):
            out += [(f"shared_expert.{kind}.{j}", p) for j, p in enumerate(getattr(recipe.shared_expert, kind))]
    return out


def check_prompts(recipe: MoFERecipe, base: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> list[str]:
    """Tokenize every prompt with the base's tokenizer (and chat template); returns warnings.

    Raises:
        PreflightError: naming the recipe file and each field whose prompt has no content tokens, or
            ``chat_template`` when the tokenizer has none.
    """
    if recipe.gate_mode == "random":
        return []
    where = recipe.path or recipe.name
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.model_max_length = 10**30  # count every token: a prompt past the context is reported, not cut here
    if recipe.chat_template and not getattr(tokenizer, "chat_template", None):
        raise PreflightError(f"{where}: chat_template: true, but the base tokenizer ({base}) has no chat template")
    context = _context(base)
    problems, warnings = [], []
    for field, prompt in _prompt_fields(recipe):
        try:
            enc = encode_prompts(tokenizer, [prompt], chat_template=recipe.chat_template)
        except ValueError:
            problems.append(f"{where}: {field}: prompt {prompt[:60]!r} has no tokens other than special tokens")
            continue
        n = int(enc["attention_mask"].sum())
        if context is not None and n > context:
            warnings.append(
                f"{field}: {n} tokens, longer than the base's context ({context}); truncated to its first {context}"
            )
    if problems:
        raise PreflightError("\n".join(problems))
    return warnings


def _context(base: Path) -> int | None:
    cfg = read_json(base / "config.json", what="model config")
    value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None
