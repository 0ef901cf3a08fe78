"""Scaled rope in a GGUF: the metadata keys and factor tensors llama.cpp reads for each transformers rope_type.

What llama.cpp computes, per type (checked in llama.cpp against transformers by tests/export/test_gguf_rope.py):

- ``linear``: ``rope.scaling.type = linear`` and ``rope.scaling.factor``; positions divided by the factor.
- ``yarn``: type, factor, ``original_context_length`` and the betas; llama.cpp applies YaRN's ramp and its default
  attention factor ``0.1·ln(factor) + 1`` itself. An explicit ``attention_factor`` is written as
  ``rope.scaling.attn_factor`` relative to that default (llama.cpp multiplies the two).
- ``llama3``: no scaling type; a ``rope_freqs`` tensor [head_dim/2] divides each frequency, as llama.cpp's
  ``convert_hf_to_gguf.py`` writes it for Llama 3.1+.
- ``longrope``: type ``longrope``, ``original_context_length``, ``rope.scaling.attn_factor`` and the
  ``rope_factors_long``/``rope_factors_short`` tensors. llama.cpp picks the long factors when its context
  (``n_ctx``, rounded up to 256) exceeds ``original_context_length``; transformers picks them when the sequence
  does. They agree when ``n_ctx`` is sized to the sequences run.

Refused, with the reason: ``dynamic`` (frequencies recomputed from the running length, which llama.cpp never does),
YaRN's DeepSeek-style ``mscale``/``mscale_all_dim`` and ``truncate: false``, partial rotary, unknown types.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moetool.arch.facts import LLAMA_CPP_ARCHS
from moetool.arch.records import MODEL_RECORDS
from moetool.export.base import ExportError
from moetool.export.jsonnum import integer, number
from moetool.io.jsontypes import JsonObject, JsonValue

if TYPE_CHECKING:
    from gguf import GGUFWriter

CONFIG = "config.json"
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass
class GGUFRope:
    """``keys``: (GGUFWriter method, value) pairs to call; ``tensors``: name → float32 [head_dim/2]."""

    rope_type: str
    keys: list[tuple[str, str | float]] = field(default_factory=list)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def rope_parameters(cfg: Mapping[str, JsonValue]) -> JsonObject:
    """The rope dict as transformers standardises it: ``rope_type``, ``rope_theta`` and, for the scaled types, an
    ``original_max_position_embeddings`` (the top-level key wins, as in transformers, then max_position_embeddings)."""
    raw = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(raw, dict):
        raise ExportError(f"{CONFIG}: rope_parameters is {raw!r}, not an object")
    p = dict(raw)
    p["rope_type"] = p.get("rope_type", p.get("type")) or "default"
    p.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if p["rope_type"] in ("llama3", "yarn", "longrope"):
        top = cfg.get("original_max_position_embeddings")
        p["original_max_position_embeddings"] = integer(
            top or p.get("original_max_position_embeddings") or cfg.get("max_position_embeddings") or 2048,
            "original_max_position_embeddings",
        )
    return p


def _refuse(rope_type: str, why: str) -> ExportError:
    return ExportError(f"{CONFIG}: rope_type {rope_type!r} cannot be written to a GGUF: {why}")


def plan_rope(cfg: Mapping[str, JsonValue], arch: str) -> GGUFRope:
    """What a GGUF of ``cfg`` under llama.cpp architecture ``arch`` needs for its rope.

    Raises:
        ExportError: a rope llama.cpp cannot compute as transformers does, naming the rope_type, the config file
            and why.
    """
    p = rope_parameters(cfg)
    kind = str(p["rope_type"])
    if kind == "default":
        return GGUFRope(kind)
    if number(p.get("partial_rotary_factor", 1.0), "partial_rotary_factor") != 1.0:
        raise _refuse(kind, "partial_rotary_factor != 1 (moetool writes rope over the whole head)")
    if kind in ("llama3", "longrope") and not LLAMA_CPP_ARCHS[arch].rope_factors:
        readers = [r.model_type for r in MODEL_RECORDS.values() if r.gguf.rope_factors]
        raise _refuse(
            kind,
            f"llama.cpp's {arch!r} architecture loads no rope factor tensors (those written for "
            f"{', '.join(readers)} do)",
        )
    head_dim = integer(
        cfg.get("head_dim")
        or integer(cfg["hidden_size"], "hidden_size") // integer(cfg["num_attention_heads"], "num_attention_heads"),
        "head_dim",
    )
    if kind == "linear":
        factor = number(p["factor"], "factor")
        return GGUFRope(kind, [("add_rope_scaling_type", "LINEAR"), ("add_rope_scaling_factor", factor)])
    if kind == "yarn":
        return _yarn(p, cfg)
    if kind == "llama3":
        return GGUFRope(kind, tensors={"rope_freqs.weight": llama3_factors(p, head_dim)})
    if kind == "longrope":
        return _longrope(p, cfg, head_dim)
    if kind == "dynamic":
        raise _refuse(
            kind,
            "dynamic NTK recomputes the frequencies from the running sequence length past max_position_embeddings, "
            "which llama.cpp does not do; use 'yarn' or 'linear' scaling, or export to ONNX within "
            "max_position_embeddings",
        )
    raise _refuse(kind, "llama.cpp has no equivalent of this rope type (supported: linear, yarn, llama3, longrope)")


def _scale_factor(p: Mapping[str, JsonValue], cfg: Mapping[str, JsonValue]) -> float:
    """transformers' ``factor``, or max_position_embeddings / original when the config leaves it out."""
    if p.get("factor") is not None:
        return number(p["factor"], "factor")
    orig = number(p["original_max_position_embeddings"], "original_max_position_embeddings")
    return number(cfg["max_position_embeddings"], "max_position_embeddings") / orig


def _yarn(p: Mapping[str, JsonValue], cfg: Mapping[str, JsonValue]) -> GGUFRope:
    if p.get("mscale") or p.get("mscale_all_dim"):
        raise _refuse("yarn", "mscale/mscale_all_dim (DeepSeek-style attention factors) are not written yet")
    if p.get("truncate", True) is False:
        raise _refuse("yarn", "truncate: false; llama.cpp always rounds YaRN's correction range to whole dimensions")
    factor = _scale_factor(p, cfg)
    keys: list[tuple[str, str | float]] = [
        ("add_rope_scaling_type", "YARN"),
        ("add_rope_scaling_factor", factor),
        (
            "add_rope_scaling_orig_ctx_len",
            integer(p["original_max_position_embeddings"], "original_max_position_embeddings"),
        ),
        ("add_rope_scaling_yarn_beta_fast", number(p.get("beta_fast") or 32.0, "beta_fast")),
        ("add_rope_scaling_yarn_beta_slow", number(p.get("beta_slow") or 1.0, "beta_slow")),
    ]
    if p.get("attention_factor") is not None:
        # llama.cpp always applies 0.1·ln(factor) + 1 inside YaRN and multiplies rope.scaling.attn_factor on top
        default = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        keys.append(("add_rope_scaling_attn_factors", number(p["attention_factor"], "attention_factor") / default))
    return GGUFRope("yarn", keys)


def llama3_factors(p: Mapping[str, JsonValue], head_dim: int) -> np.ndarray:
    """[head_dim/2] divisors of the base frequencies: 1 for short wavelengths, ``factor`` for long ones, smoothed
    between (Llama 3.1's scheme, as llama.cpp's converter writes ``rope_freqs``)."""
    base = number(p["rope_theta"], "rope_theta")
    factor = number(p.get("factor", 8.0), "factor")
    low, high = (
        number(p.get("low_freq_factor", 1.0), "low_freq_factor"),
        number(p.get("high_freq_factor", 4.0), "high_freq_factor"),
    )
    old_ctx = number(p["original_max_position_embeddings"], "original_max_position_embeddings")
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))
    return out.astype(np.float32)


def _longrope(p: Mapping[str, JsonValue], cfg: Mapping[str, JsonValue], head_dim: int) -> GGUFRope:
    orig = integer(p["original_max_position_embeddings"], "original_max_position_embeddings")
    factor = _scale_factor(p, cfg)
    given = p.get("attention_factor")
    if given is None:
        attn = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
    else:
        attn = number(given, "attention_factor")
    long_f, short_f = (np.asarray(p[k], dtype=np.float32) for k in ("long_factor", "short_factor"))
    if long_f.shape != (head_dim // 2,) or short_f.shape != (head_dim // 2,):
        raise _refuse("longrope", f"long_factor/short_factor must hold head_dim/2 = {head_dim // 2} numbers")
    return GGUFRope(
        "longrope",
        [
            ("add_rope_scaling_type", "LONGROPE"),
            ("add_rope_scaling_orig_ctx_len", orig),
            ("add_rope_scaling_attn_factors", attn),
        ],
        {"rope_factors_long.weight": long_f, "rope_factors_short.weight": short_f},
        [
            f"longrope: llama.cpp uses the long factors when n_ctx > {orig} (original_max_position_embeddings) and "
            "the short ones otherwise; transformers switches on the sequence length instead"
        ],
    )


def write_rope_metadata(w: GGUFWriter, rope: GGUFRope) -> None:
    """Call the GGUFWriter ``w`` for each key of ``rope`` (scaling types given by their RopeScalingType name)."""
    import gguf

    for method, value in rope.keys:
        arg = gguf.RopeScalingType[str(value)] if method == "add_rope_scaling_type" else value
        getattr(w, method)(arg)
