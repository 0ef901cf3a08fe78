"""mlx-lm's saved layout told apart from a Hugging Face checkpoint, and read for its parameter shapes.

An mlx-lm folder (``moetool export --target mlx``, ``mlx_lm.convert``) looks like a Hugging Face one (``config.json``,
safetensors) but holds mlx-lm's modules: a quantized ``Linear`` or ``Embedding`` is a ``uint32`` ``weight`` packing
``32 / bits`` values per word beside its per-group ``scales`` (and, in the affine mode, ``biases``), with the bits in
``config.json``'s ``quantization`` (a default and an entry per module); a layer's experts are one ``[E, rows, cols]``
tensor per projection (``switch_mlp.{gate,up,down}_proj``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from moetool.errors import SourceError
from moetool.io.checkpoint import Checkpoint, TensorInfo
from moetool.io.safe import read_json

PACKED_DTYPE = "U32"  # the safetensors tag of a packed weight
WORD_BITS = 32
SWITCH = ".switch_mlp."  # mlx-lm's stacked experts of a layer


def _bits(config: Mapping[str, object], module: str) -> int | None:
    """The bits of ``module``'s quantization: its own entry in ``quantization``, else the default; None if unsaid."""
    q = config.get("quantization")
    if not isinstance(q, Mapping):
        return None
    own = q.get(module)
    bits = own.get("bits") if isinstance(own, Mapping) else q.get("bits")
    return bits if isinstance(bits, int) and bits > 0 else None


def packed_modules(tensors: Mapping[str, TensorInfo]) -> list[str]:
    """The modules stored quantized: a ``uint32`` ``weight`` with ``scales`` beside it."""
    return [
        n.removesuffix(".weight")
        for n, info in tensors.items()
        if n.endswith(".weight") and info.dtype == PACKED_DTYPE and f"{n.removesuffix('.weight')}.scales" in tensors
    ]


def mlx_layout(config: Mapping[str, object], tensors: Mapping[str, TensorInfo]) -> str | None:
    """What marks a folder (its config dict and tensors) as mlx-lm's layout, in words; None for a Hugging Face one."""
    packed = packed_modules(tensors)
    if packed:
        return f"quantized packed weights, {len(packed)} modules of uint32 words with per-group scales"
    if isinstance(config.get("quantization"), Mapping):
        return "quantized weights, by config.json's 'quantization' section"
    if any(SWITCH in n for n in tensors):
        return "experts stacked in mlx-lm's switch_mlp modules"
    return None


def parameter_shapes(config: Mapping[str, object], tensors: Mapping[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
    """Every parameter tensor's shape as the model computes with it: a packed weight of an N-bit module unpacked
    (``32 / N`` values per ``uint32`` word of its last axis); the ``scales`` and ``biases`` of a quantized module are
    its quantization, not parameters, and are left out. A Hugging Face checkpoint's shapes come back as they are.

    Raises:
        SourceError: a packed module whose bits ``config.json``'s ``quantization`` does not give.
    """
    packed = set(packed_modules(tensors))
    out: dict[str, tuple[int, ...]] = {}
    for name, info in tensors.items():
        module, _, part = name.rpartition(".")
        if module in packed and part in ("scales", "biases"):
            continue
        shape = info.shape
        if module in packed and part == "weight":
            bits = _bits(config, module)
            if bits is None:
                raise SourceError(
                    f"{name} is packed (uint32 words), but config.json's 'quantization' gives no bits for {module}: "
                    "the folder's config.json is not the one mlx-lm wrote with these weights"
                )
            shape = (*shape[:-1], shape[-1] * WORD_BITS // bits)
        out[name] = shape
    return out


def check_not_mlx_folder(model_dir: Path) -> None:
    """Refuse an mlx-lm folder given as the model to export: every target reads a Hugging Face checkpoint, and mlx-lm's
    modules (packed words, stacked experts) have no place in any of them.

    Raises:
        SourceError: naming the folder as an MLX export, what marks it, and the folder to give instead (the one its
            ``manifest.json`` says it was exported from, where it says so).
    """
    ck = Checkpoint(model_dir)
    try:
        reason = mlx_layout(ck.config, ck.tensors)
    finally:
        ck.close()
    if reason is None:
        return
    manifest = model_dir / "manifest.json"
    doc = read_json(manifest, what="the export's manifest", error=SourceError) if manifest.is_file() else {}
    model = doc.get("model") if isinstance(doc, dict) else None
    source = model.get("path") if isinstance(model, dict) else None
    made_from = f" ({source}, its manifest.json's model.path)" if isinstance(source, str) else ""
    raise SourceError(
        f"{model_dir} is an MLX export (mlx-lm's layout: {reason}), not a model to export from: no target reads "
        f"mlx-lm's weights back. Give the merged Hugging Face model folder it was made from{made_from}"
    )
