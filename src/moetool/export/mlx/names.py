"""Hugging Face tensor names → mlx-lm module paths, and a plan's types → MLX's affine quantization (data).

mlx-lm quantizes per module (``nn.Linear``, ``nn.Embedding``, the stacked ``SwitchLinear`` of a layer's experts),
so a plan made over the Hugging Face names (roles and globs as for GGUF) is read per module: every tensor that feeds
one module must have one type — a layer's experts are one ``[E, rows, cols]`` tensor there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from moetool.arch.outputs import MoEArch
from moetool.quant.devices import MLX_PRECISIONS
from moetool.quant.types import get_type

# plan type → bits of MLX's affine quantization (scale and bias per group); floats are kept as floats
FLOAT_TYPES = ("f32", "f16", "bf16")
GROUP_SIZES = (64, 32)  # mlx-lm's default group first; 32 for rows 64 does not divide


def mlx_precision(type_name: str) -> str:
    """The MLX precision a plan type is stored as: the float itself, or ``N-bit`` by the type's nominal bits
    (q8_0 → 8-bit, q4_k → 4-bit, iq2_xs → 2-bit).

    Raises:
        ValueError: a type with no whole number of bits MLX stores.
    """
    t = get_type(type_name).name
    if t in FLOAT_TYPES:
        return t
    digits = re.match(r"i?q(\d)", t)
    bits = int(digits.group(1)) if digits else 0
    if f"{bits}-bit" not in MLX_PRECISIONS:
        raise ValueError(f"type {t} has no MLX precision (MLX stores {', '.join(MLX_PRECISIONS)})")
    return f"{bits}-bit"


def bits_of(precision: str) -> int | None:
    """``4-bit`` → 4; a float precision → None."""
    return int(precision.split("-", maxsplit=1)[0]) if precision.endswith("-bit") else None


def _template_regex(template: str) -> re.Pattern[str]:
    marked = re.escape(template.format(layer="LAYERMARK", expert="EXPERTMARK", proj="PROJMARK"))
    pattern = marked.replace("LAYERMARK", r"(?P<layer>\d+)").replace("EXPERTMARK", r"\d+")
    return re.compile(pattern.replace("PROJMARK", r"(?P<proj>\w+)"))


def module_paths(arch: MoEArch | None, hf_names: Iterable[str]) -> dict[str, list[str]]:
    """mlx-lm module path → the Hugging Face tensors that become its weight (sorted; biases and 1-D tensors are
    parameters of their module, never quantized, and left out)."""
    expert = _template_regex(arch.expert) if arch is not None and arch.expert else None
    inverse = {v: k for k, v in arch.proj_map.items()} if arch is not None else {}
    stacked = [(_template_regex(t), projs) for t, projs in (arch.stacked if arch is not None else ())]
    out: dict[str, list[str]] = {}
    for name in sorted(hf_names):
        if not name.endswith(".weight"):
            continue
        paths = [name.removesuffix(".weight")]
        m = expert.fullmatch(name) if expert is not None else None
        if m is not None and arch is not None:
            proj = inverse.get(m["proj"], m["proj"])
            paths = [arch.mlx_switch.format(layer=m["layer"], proj=proj)]
        for regex, projs in stacked:
            s = regex.fullmatch(name)
            if s is not None and arch is not None:
                paths = [arch.mlx_switch.format(layer=s["layer"], proj=p) for p in projs]
        for path in paths:
            out.setdefault(path, []).append(name)
    return out


def module_precisions(paths: Mapping[str, list[str]], type_of: Mapping[str, str]) -> dict[str, str]:
    """Each module's MLX precision from the plan's per-tensor types (``type_of``: HF name → plan type).

    Raises:
        ValueError: the tensors of one module have different precisions (a glob that splits a layer's experts),
            naming the module and the types.
    """
    out: dict[str, str] = {}
    for path, names in paths.items():
        found = {mlx_precision(type_of[n]) for n in names if n in type_of}
        if len(found) > 1:
            raise ValueError(
                f"{path} holds {len(names)} tensors ({names[0]}, …) as one MLX array, but the plan gives them "
                f"{', '.join(sorted(found))}: give them one type (a rule by role, or a glob over the whole layer)"
            )
        if found:
            out[path] = found.pop()
    return out


__all__ = ["GROUP_SIZES", "MLX_PRECISIONS", "bits_of", "mlx_precision", "module_paths", "module_precisions"]
