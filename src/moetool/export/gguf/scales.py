"""Granite's scales as llama.cpp's GGUF keys: embedding, residual and attention multipliers, and the logit divisor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from moetool.arch.facts import LlamaCppArch
from moetool.export.jsonnum import number
from moetool.io.jsontypes import JsonValue

if TYPE_CHECKING:
    from gguf import GGUFWriter


def write_scales(w: GGUFWriter, cfg: Mapping[str, JsonValue], arch: LlamaCppArch) -> None:
    """Write the scales ``arch`` reads (``LlamaCppArch.scales``) from ``cfg``, 1.0 where the config leaves one out
    (transformers' default).

    An attention scale of 0 would mean 1/sqrt(head_dim) to llama.cpp; transformers' granite multiplies by the
    multiplier itself, so it is written as it is."""
    for key, method in arch.scales:
        value = cfg.get(key)
        getattr(w, method)(number(1.0 if value is None else value, key))
