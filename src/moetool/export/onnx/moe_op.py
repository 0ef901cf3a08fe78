"""``moetool::sparse_moe`` in ONNX: onnxruntime's ``com.microsoft.MoE`` (fp32 experts) and, for a plan that
quantizes a layer's experts, ``com.microsoft.QMoE`` (8 bits per row, or 4 bits in blocks of 32), both run by its CPU
provider with only each token's top-k experts computed. :mod:`moetool.export.onnx.layout` turns an MoE node into
QMoE; :func:`quantize_experts` rounds its weights.

What onnxruntime 1.31 computes (checked against the torch op in tests): ``router_probs`` takes the logits (the op
applies the softmax); ``activation_type=swiglu`` with ``swiglu_fusion=1`` needs gate and up rows interleaved in fc1
and, with alpha 1, beta 0 and no limit, is exactly ``silu(g) * u``; the CPU provider accepts no other SwiGLU layout.
QMoE ignores ``normalize_routing_weights=0`` unless ``router_weights`` is given, so the softmax of the logits is
always passed there. QMoE's 8-bit block-wise form quantizes activations (as MatMulNBits does at accuracy level 4,
moetool's default), so 8-bit experts are stored in blocks of 32 then, and per row (exact) at level 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

SWIGLU: dict[str, int | str] = {"activation_type": "swiglu", "swiglu_fusion": 1}


def register_moe_schema() -> None:
    """Make ``com.microsoft.MoE`` known to onnx (onnxscript looks ops up there while the exporter traces)."""
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has("MoE", 1, "com.microsoft"):
        return
    opt = OpSchema.FormalParameterOption.Optional
    param = OpSchema.FormalParameter
    onnx.defs.register_schema(
        OpSchema(
            "MoE",
            "com.microsoft",
            1,
            inputs=[
                param("input", "T"),
                param("router_probs", "T"),
                param("fc1_experts_weights", "T"),
                param("fc1_experts_bias", "T", param_option=opt),
                param("fc2_experts_weights", "T"),
            ],
            outputs=[param("output", "T")],
            type_constraints=[("T", ["tensor(float)"], "fp32 activations and weights")],
            attributes=[
                OpSchema.Attribute("k", OpSchema.AttrType.INT, "experts per token"),
                OpSchema.Attribute("activation_type", OpSchema.AttrType.STRING, "swiglu"),
                OpSchema.Attribute("swiglu_fusion", OpSchema.AttrType.INT, "1: gate and up interleaved in fc1"),
                OpSchema.Attribute("normalize_routing_weights", OpSchema.AttrType.INT, "renormalise the top-k"),
            ],
        )
    )


def translation_table() -> dict[Callable[..., object], Callable[..., object]]:
    """``custom_translation_table`` for ``torch.onnx.export``: the sparse op as one MoE node."""
    import onnxscript
    import torch

    from moetool.export.graph import sparse  # noqa: F401  (registers the op)

    register_moe_schema()
    msft = onnxscript.values.Opset("com.microsoft", 1)
    op = onnxscript.opset18

    def moe(x: Any, logits: Any, fc1: Any, fc2: Any, k: int, normalize: bool) -> Any:
        out = msft.MoE(x, logits, fc1, None, fc2, k=k, normalize_routing_weights=1, **SWIGLU)
        if normalize:
            return out
        # onnxruntime 1.31's MoE renormalises the top-k whatever normalize_routing_weights says (QMoE too, without
        # router_weights): the un-normalised mixture is the renormalised one times the chosen experts' softmax share
        count: Any = op.Constant(value_ints=[k])  # an INT64 tensor (onnxscript types Constant's output loosely)
        last: Any = op.Constant(value_ints=[-1])
        top, _ = op.TopK(op.Softmax(logits, axis=-1), count, axis=-1)
        return op.Mul(out, op.ReduceSum(top, last, keepdims=1))

    return {torch.ops.moetool.sparse_moe.default: moe}


def quantize_experts(w: np.ndarray, bits: int, block: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric, zero point 2^(bits−1) (QMoE's default): ``w`` [E, N, K] → (uint8 [E, N, K·bits/8], 4-bit element 2i
    in the low nibble; scales [E, N] per row or [E, N, K/block])."""
    e, n, k = w.shape
    size = k if block is None else block
    wb = w.reshape(e, n, k // size, size)
    scale = (np.abs(wb).max(-1) / (2 ** (bits - 1) - 1)).astype(np.float32)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(wb / scale[..., None]) + 2 ** (bits - 1), 0, 2**bits - 1).astype(np.uint8).reshape(e, n, k)
    if bits == 4:
        q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return q, (scale[..., 0] if block is None else scale)
