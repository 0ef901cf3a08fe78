"""What a mofe recipe can be checked for with the base's tokenizer and config but no weights: prompts that tokenize
to nothing, prompts longer than the base's context, ``chat_template: true`` without a template.

Run by ``moetool validate`` (when the base resolves locally) and at the start of every plan, so a bad prompt fails in
a second rather than after minutes of router computation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moetool.errors import PreflightError
from moetool.io.safe import read_json
from moetool.recipe.mofe import MoFERecipe
from moetool.routing.init import encode_prompts

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


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


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a checkpoint directory, or None if it has none; its JSON files are read strictly first, so a
    malformed one is named (file, line, column) instead of failing inside transformers."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    for name, what in (("tokenizer.json", "tokenizer"), ("tokenizer_config.json", "tokenizer config")):
        if (path / name).is_file():
            read_json(path / name, what=what, max_bytes=256 * 2**20)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def check_prompts(recipe: MoFERecipe, base: Path, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Tokenize every prompt with the base's tokenizer (and chat template); returns warnings.

    Raises:
        PreflightError: naming the recipe file and each field whose prompt has no content tokens, or
            ``chat_template`` when the tokenizer has none.
    """
    if recipe.gate_mode == "random":
        return []
    where = recipe.path or recipe.name
    if recipe.chat_template and not getattr(tokenizer, "chat_template", None):
        raise PreflightError(f"{where}: chat_template: true, but the base tokenizer ({base}) has no chat template")
    context = _context(base)
    problems, warnings = [], []
    limit = tokenizer.model_max_length
    tokenizer.model_max_length = 10**30  # count every token: a prompt past the context is reported, not cut here
    try:
        encoded = [
            (field, prompt, _encode(tokenizer, prompt, recipe.chat_template))
            for field, prompt in _prompt_fields(recipe)
        ]
    finally:
        tokenizer.model_max_length = limit
    for field, prompt, enc in encoded:
        if enc is None:
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


def _encode(tokenizer: PreTrainedTokenizerBase, prompt: str, chat_template: bool) -> dict[str, torch.Tensor] | None:
    """The prompt's encoding, or None when it has no tokens but special ones."""
    try:
        return encode_prompts(tokenizer, [prompt], chat_template=chat_template)
    except ValueError:
        return None


def _context(base: Path) -> int | None:
    cfg = read_json(base / "config.json", what="model config")
    value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None
