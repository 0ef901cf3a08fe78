"""Granite's scales as llama.cpp's GGUF keys: embedding, residual and attention multipliers, and the logit divisor."""

from __future__ import annotations

from typing import Any

from moetool.arch.facts import LlamaCppArch


def write_scales(w: Any, cfg: dict[str, Any], arch: LlamaCppArch) -> None:
    """Write the scales ``arch`` reads (``LlamaCppArch.scales``) from ``cfg``, 1.0 where the config leaves one out
    (transformers' default).

    An attention scale of 0 would mean 1/sqrt(head_dim) to llama.cpp; transformers' granite multiplies by the
    multiplier itself, so it is written as it is."""
    for key, method in arch.scales:
        value = cfg.get(key)
        getattr(w, method)(float(1.0 if value is None else value))
