"""What a platform's LLM runner is compared with when it generates from an exported artifact: transformers' greedy
continuation of the same prompt, and the tokens that end a generation. Shared by the runner checks of ExecuTorch
(TextLLMRunner) and TFLite (LiteRT-LM)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["common_prefix", "greedy_reference", "stop_ids"]


def stop_ids(model_dir: Path) -> list[int]:
    """The ids that end a generation of the model in ``model_dir``: ``generation_config.json``'s ``eos_token_id``
    (one or several), then the tokenizer's end token, each once, in that order."""
    from transformers import AutoTokenizer

    gen = model_dir / "generation_config.json"
    given = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos = AutoTokenizer.from_pretrained(str(model_dir)).eos_token_id
    stops: list[int] = []
    for i in [*(given if isinstance(given, list) else [given]), eos]:
        if isinstance(i, int) and i not in stops:
            stops.append(i)
    return stops


def greedy_reference(
    hf: nn.Module,
    prompt: list[int],
    new_tokens: int,
    stops: set[int] | list[int],
    *,
    vocab: int | None = None,
    keep_stop: bool = True,
) -> list[int]:
    """transformers' greedy continuation of ``prompt``: the argmax after each prefix (over the first ``vocab`` ids: a
    runner samples over its tokenizer's vocabulary, which a padded embedding may exceed), up to ``new_tokens`` or a
    stop token (kept with ``keep_stop``, as ExecuTorch's runner prints it; LiteRT-LM's text leaves it out). One full
    forward per token (:func:`moetool.export.heldout.reference_logits`): a reference streamed from disk keeps no
    cache."""
    from moetool.export.heldout import reference_logits

    ids = list(prompt)
    out: list[int] = []
    while len(out) < new_tokens:
        nxt = int(reference_logits(hf, [ids])[0][-1][:vocab].argmax())
        if nxt in stops and not keep_stop:
            break
        out.append(nxt)
        ids.append(nxt)
        if nxt in stops:
            break
    return out


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items ``a`` and ``b`` share (where a runner's generation and transformers' part)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
