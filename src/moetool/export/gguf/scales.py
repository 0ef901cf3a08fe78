"""Granite's scales as llama.cpp's GGUF keys: embedding, residual and attention multipliers, and the logit divisor."""

from __future__ import annotations

from typing import Any

# llama.cpp architectures that read the scales (granitemoe requires logit_scale), and config key → GGUFWriter method
SCALED_ARCHS = ("granite", "granitemoe")
SCALE_KEYS = (
    ("embedding_multiplier", "add_embedding_scale"),
    ("residual_multiplier", "add_residual_scale"),
    ("attention_multiplier", "add_attention_scale"),
    ("logits_scaling", "add_logit_scale"),  # llama.cpp divides the logits by it, as transformers does
)


def write_scales(w: Any, cfg: dict[str, Any], arch: str) -> None:
    """Write the scales of ``cfg`` for a scaled ``arch`` (1.0 where the config leaves one out, transformers' default).

    An attention scale of 0 would mean 1/sqrt(head_dim) to llama.cpp; transformers' granite multiplies by the
    multiplier itself, so it is written as it is."""
    if arch not in SCALED_ARCHS:
        return
    for key, method in SCALE_KEYS:
        value = cfg.get(key)
        getattr(w, method)(float(1.0 if value is None else value))
