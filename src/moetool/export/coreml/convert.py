"""A Core ML chunk converted and compressed: the traced wrapper converted to an iOS 18 ML Program with its KV cache as
states (:func:`convert`), then its weights compressed per the plan by name (:func:`compress`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from moetool.export.coreml.join import CHAIN
from moetool.export.coreml.stateful import STATES, StatefulChunk
from moetool.export.graph.model import causal_mask

if TYPE_CHECKING:
    from coremltools.models import MLModel
    from coremltools.optimize.coreml import OpLinearQuantizerConfig

__all__ = ["BLOCK", "compress", "convert", "weight_op_name"]

BLOCK = 32


def convert(chunk: StatefulChunk, fp16: bool, compute_units: str) -> MLModel:
    """``chunk`` traced and converted: ``inputIds`` [1, T] (the first chunk) or ``hiddenStates`` [1, T, D] in with
    ``causalMask`` [1, 1, T, E] beside, ``logits`` (the last) or ``nextHiddenStates`` out, states ``keyCache`` and
    ``valueCache``; T up to its capacity, a range (swift-transformers reads the context length from it). The mask is
    float16 as in Apple's stateful Llama (float32 for a float32 program); its query axis is T, not broadcast: the
    attention stacks GQA's query heads along it."""
    import coremltools as ct

    capacity = chunk.capacity
    dt = np.float16 if fp16 else np.float32
    seq = ct.RangeDim(1, capacity)
    if chunk.first:
        x = torch.zeros(1, 8, dtype=torch.long)
        first = ct.TensorType(name="inputIds", shape=(1, seq), dtype=np.int32)
    else:
        hidden = chunk.hidden_size
        x = torch.zeros(1, 8, hidden)
        first = ct.TensorType(name=CHAIN[0], shape=(1, seq, hidden), dtype=dt)
    example = (x, causal_mask(8, 0))
    with torch.no_grad():
        traced = torch.jit.trace(chunk, example)
    ml = ct.convert(
        traced,
        inputs=[first, ct.TensorType(name="causalMask", shape=(1, 1, seq, ct.RangeDim(1, capacity)), dtype=dt)],
        outputs=[ct.TensorType(name="logits" if chunk.last else CHAIN[1], dtype=dt)],
        states=[
            ct.StateType(wrapped_type=ct.TensorType(shape=tuple(chunk.keyCache.shape), dtype=dt), name=n)
            for n in STATES
        ],
        minimum_deployment_target=ct.target.iOS18,
        convert_to="mlprogram",
        compute_precision=ct.precision.FLOAT16 if fp16 else ct.precision.FLOAT32,
        compute_units=getattr(ct.ComputeUnit, compute_units),
        skip_model_load=True,
    )
    return ml


def weight_op_name(export_name: str, fp16: bool) -> str:
    """The const op Core ML names after a wrapper parameter (``model.`` prefix, dots → underscores)."""
    base = "model_" + export_name.replace(".", "_")
    return base + ("_to_fp16" if fp16 else "")


def compress(ml: MLModel, precisions: dict[str, str], fp16: bool) -> tuple[MLModel, dict[str, str]]:
    """int4 per-block (32) or int8 per-channel linear quantization by weight name; others untouched."""
    import coremltools.optimize.coreml as cto

    meta = cto.get_weights_metadata(ml, weight_threshold=64)  # lower thresholds trip on list consts
    configs: dict[str, OpLinearQuantizerConfig] = {}
    applied: dict[str, str] = {}
    for name, p in precisions.items():
        op = weight_op_name(name, fp16)
        if op not in meta or p == "fp32":
            continue
        if p == "int4":
            # blocks run along the input axis; an input width 32 does not divide takes the largest block that does
            k = int(meta[op].val.shape[-1])
            block = next((b for b in (BLOCK, 16, 8, 4) if k % b == 0), None)
            if block is None:
                configs[op] = cto.OpLinearQuantizerConfig(
                    mode="linear_symmetric", dtype="int4", granularity="per_channel", weight_threshold=1
                )
                applied[name] = "int4 per channel"
                continue
            configs[op] = cto.OpLinearQuantizerConfig(
                mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=block, weight_threshold=1
            )
            applied[name] = f"int4 block {block}"
            continue
        configs[op] = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=1
        )
        applied[name] = "int8 per channel"
    if not configs:
        return ml, applied
    return cto.linear_quantize_weights(ml, cto.OptimizationConfig(op_name_configs=configs)), applied
