"""The manifest's ``moe_kernel`` field for the graph targets that keep the MoE dense-masked (ExecuTorch, LiteRT, Core
ML): the
same shape as ONNX's (``kind``, ``op``, ``layers``), plus the ``reason`` the sparse form was not written.

Selecting each token's top-k experts in a static graph takes one of two forms, and neither runtime runs either fast
(``bench/graph_moe_forms.py`` times each form against the dense one at a model's MoE shapes):

- *control flow* (``torch.cond`` per expert: the weights stay in place and stay quantized): XNNPACK in ExecuTorch
  delegates a Linear only when its weight is a static parameter of the top-level graph, so lowering a graph with
  experts inside the branches fails (their Linears neither delegated nor decomposed); litert-torch has no lowering
  for ``cond`` at all.
- *gathered weights* (``index_select`` of the k experts' rows from the stacked ``[E, F, D]`` weights, then a batched
  matmul): every step copies k experts' weights before multiplying them, and the batched matmul takes dynamic weights
  (no int8/int4 weights: ai-edge-quantizer and torchao quantize FULLY_CONNECTED/Linear weights, which these no
  longer are, and XNNPACK's bmm is fp32 only). Even with no overhead, copying k experts and then reading them reads
  2k/E of the dense form's weight bytes (and writes k experts' more): more than the dense form whenever E < 2k (the
  demo MoE: 3 experts, top-2, 4/3).
"""

from __future__ import annotations

from moetool.io.jsontypes import JsonObject

REASONS: dict[str, str] = {
    "executorch": (
        "XNNPACK delegates Linear only with static weights in the top-level graph: per-expert torch.cond branches "
        "are left undelegated (lowering fails), and gathered expert weights (index_select, a portable op copying k "
        "experts' weights every step) feed bmm, which XNNPACK runs in fp32 only: at 8 experts, top-2, SmolLM2-360M's "
        "shape, one decode token through two MoE blocks took 16.8 ms gathered against 16.5 ms dense-masked, both "
        "fp32 (bench/graph_moe_forms.py), while the dense form also takes int4 weights. ExecuTorch's fused MoE operator (llama::quantized_moe_ffn) has only its "
        "reference kernel off aarch64, which dequantizes each chosen expert to fp32 on every call: one decode token "
        "at 8 experts, top-2, hidden 960 took 36.7 ms against 1.58 ms dense-masked at int4; and its weights must be "
        "packed by torchao's MoE packing op, which torchao 0.18 (the release executorch 1.5.1 pins) lacks, so it is "
        "not written for an aarch64 device either"
    ),
    "tflite": (
        "litert-torch has no lowering for torch.cond, and gathered expert weights (GATHER + BATCH_MATMUL) are copied "
        "every step and cannot take FULLY_CONNECTED's int8/int4 weight quantization: at 8 experts, top-2, "
        "SmolLM2-360M's shape, one decode token through two MoE blocks took 32.3 ms gathered against 17.0 ms "
        "dense-masked, both fp32 (bench/graph_moe_forms.py)"
    ),
}

REASONS["coreml"] = (
    "Core ML has no sparse-expert primitive, and what the runtime does with compressed weights outside a Linear is "
    "undocumented: constexpr_blockwise_shift_scale weights are decompressed 'either at model load time or runtime' "
    "by backend (coremltools ops/defs/iOS18/compression.py; docs opt-overview), so gathering the chosen rows of a "
    "stacked 4-bit expert tensor may hold every expert in fp16; third-party tests report dynamic weight slicing, "
    "topk and cond blocks running on the CPU only (fxlin/Anemll-PhiMoe-exp), and one function per expert "
    "(multifunction models) needs a host round trip per MoE layer per token. Not measured here: Core ML runs only "
    "on Apple hardware"
)

OPS: dict[str, str] = {
    "coreml": "every expert as linear ops with their compressed (constexpr) weights, unchosen ones weighted 0",
    "executorch": "every expert as XNNPACK-delegated Linears, unchosen ones weighted 0",
    "tflite": "every expert as FULLY_CONNECTED ops (XNNPACK delegate), unchosen ones weighted 0",
}


def dense_moe_kernel(target: str, moe_layers: int) -> JsonObject:
    """The ``moe_kernel`` manifest field of ``target`` (executorch, tflite or coreml), whose ``moe_layers`` MoE blocks are
    all dense-masked; ``reason`` is None for a model without MoE blocks (nothing to select)."""
    if target not in REASONS:
        raise ValueError(f"no dense-masked MoE kernel record for target {target!r}: {', '.join(REASONS)}")
    return {
        "kind": "dense-masked",
        "op": OPS[target],
        "layers": moe_layers,
        "reason": REASONS[target] if moe_layers else None,
    }
