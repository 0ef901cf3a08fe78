"""The transformers reference an exported artifact is checked against: in which dtype it is held, and whether it is
held at all or streamed from disk one layer at a time (:mod:`moetool.compute.stream`), from the model's size and the
memory available. Every exporter that verifies against transformers (GGUF, ONNX) decides it here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moetool.compute.stream import TensorSource

__all__ = [
    "HELD_REFERENCE_LIMIT",
    "VERIFY_OVERHEAD",
    "GraphReference",
    "graph_reference",
    "graph_reference_need",
    "held_reference",
    "reference_dtype",
    "reference_label",
    "reference_model",
    "stored_dtype",
    "stream_reference",
    "streamed_need",
]


def stored_dtype(config: Mapping[str, object]) -> str:
    """The dtype ``config.json`` says the weights are stored in (``dtype``, or the older ``torch_dtype``; float32
    when it says none)."""
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def reference_dtype(params: int, config: Mapping[str, object]) -> str:
    """The dtype the transformers reference holds its weights in: float32 when that takes at most half the available
    memory, else the checkpoint's own 16-bit dtype (a bf16 MoE of 5B parameters is 21 GB in float32). Either way it
    computes in float32 (:func:`reference_model`) and its figures are the same; the 16-bit copy is slower by the
    per-layer casts and needs half the memory.

    Raises:
        BudgetError: ``MOETOOL_MEMORY_BUDGET`` is not a size.
    """
    from moetool.io.budget import available_memory

    own = stored_dtype(config)
    if own not in ("bfloat16", "float16"):
        return "float32"
    mem = available_memory()
    return "float32" if mem is None or params * 4 + VERIFY_OVERHEAD <= mem // 2 else own


VERIFY_OVERHEAD = 1 << 30  # activations of the probe windows, the tokenizer, the runtime


def stream_reference(params: int, config: Mapping[str, object]) -> bool:
    """Whether the transformers reference must stream its layers from disk: when even its copy in the checkpoint's
    own dtype (with one float32 layer, :func:`reference_dtype`) would not fit in the available memory.

    Raises:
        BudgetError: ``MOETOOL_MEMORY_BUDGET`` is not a size.
    """
    from moetool.compute.upcast import float32_overhead
    from moetool.io.budget import available_memory

    mem = available_memory()
    own = reference_dtype(params, config)
    held = params * 4 if own == "float32" else params * 2 + float32_overhead(params, config)
    return mem is not None and held + VERIFY_OVERHEAD > mem


def streamed_need(params: int, config: Mapping[str, object]) -> int:
    """Bytes a streamed reference holds: the weights outside the layer stack and one layer in float32
    (:func:`moetool.compute.stream.streamed_weight_bytes`) and the verification's activations
    (:data:`VERIFY_OVERHEAD`)."""
    from moetool.compute.stream_bytes import streamed_weight_bytes

    return streamed_weight_bytes(config, params) + VERIFY_OVERHEAD


HELD_REFERENCE_LIMIT = 1 << 30  # float32 bytes under which a graph target holds its reference (and checks its wrapper)


def held_reference(params: int, config: Mapping[str, object]) -> bool:
    """Whether a graph target's verification holds the transformers reference in float32 (and checks the torch
    export model over its weights): only for a model under :data:`HELD_REFERENCE_LIMIT` in float32 that fits.
    Larger ones are streamed from disk one layer at a time, the same figures for one layer's memory, so the export's
    peak is the artifact's, not the model held whole."""
    return params * 4 <= HELD_REFERENCE_LIMIT and not stream_reference(params, config)


def graph_reference_need(params: int, config: Mapping[str, object]) -> tuple[int, bool]:
    """(bytes, held) of a graph target's reference (:func:`graph_reference`): the float32 model and the
    verification's allowance when :func:`held_reference`, else a streamed reference's (:func:`streamed_need`)."""
    held = held_reference(params, config)
    return (params * 4 + VERIFY_OVERHEAD if held else streamed_need(params, config)), held


@dataclass(frozen=True)
class GraphReference:
    """The transformers model a graph artifact is checked against, how its parity record names it, and whether it is
    held in float32 (then the torch export model over its weights can be checked too) or streamed from disk."""

    model: nn.Module
    label: str
    held: bool


def graph_reference(path: Path, params: int, config: Mapping[str, object]) -> GraphReference:
    """The reference of a graph target's check (ONNX, Core ML, ExecuTorch): held in float32 for a small model
    (:func:`held_reference`), else streamed from disk one layer at a time over the checkpoint's own dtype."""
    import torch

    held = held_reference(params, config)
    storage = "float32" if held else stored_dtype(config)
    model = reference_model(Path(path), getattr(torch, storage), streamed=not held)
    return GraphReference(model, reference_label(storage, not held), held)


def reference_model(
    path: Path, storage: torch.dtype, *, streamed: bool = False, tensors: TensorSource | None = None
) -> nn.Module:
    """The transformers reference at ``path``, held in ``storage`` and computing in float32: a 16-bit model runs one
    float32 layer at a time (:func:`moetool.compute.upcast.float32_layer_by_layer`), which gives a float32 model's
    logits in about half its memory; ``streamed``, its layers are read from disk as each runs
    (:func:`moetool.compute.stream.streamed_causal_lm`: the same logits for one layer's memory), from ``tensors``
    instead of the folder's safetensors where given."""
    from transformers import AutoModelForCausalLM

    from moetool.compute.stream import streamed_causal_lm
    from moetool.compute.upcast import float32_layer_by_layer

    if streamed or tensors is not None:
        return streamed_causal_lm(Path(path), storage=storage, tensors=tensors)
    return float32_layer_by_layer(AutoModelForCausalLM.from_pretrained(str(path), dtype=storage).eval())


def reference_label(storage: str, streamed: bool = False) -> str:
    """What a parity record names as its reference: a :func:`reference_model` held in ``storage``, or streamed."""
    if streamed:
        return f"transformers float32, layer by layer streamed from disk over {storage} weights"
    if storage == "float32":
        return "transformers float32"
    return f"transformers float32, layer by layer over {storage} weights"
