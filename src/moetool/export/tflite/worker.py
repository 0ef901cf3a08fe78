"""One TFLite model from some decoder layers, converted where litert-torch is installed (an isolated venv:
litert-torch pins typing-extensions and pydantic below what the rest of moetool's stack needs), one process per
chunk, so nothing a conversion leaves allocated outlives it:

    python -m moetool.export.tflite.worker REQUEST.json

REQUEST has model_dir, layers ``[start, stop)``, first and last (whether the chunk embeds the tokens and computes
the logits), path (the ``.tflite`` to write), precisions (export name → fp32|int8|int4), capacity and prefill_len;
for a whole model, optionally litertlm (true: LiteRT-LM's layout) and bundle (path, tokenizer, start_ids, stop_ids:
the ``.litertlm`` to write around the quantized model). The layers are read from the checkpoint alone
(:mod:`moetool.export.graph.stream`), given a static cache (:class:`~moetool.export.graph.static.StaticCacheLM`, or
:class:`~moetool.export.tflite.litertlm.LiteRTLMModel`), converted with two signatures, ``prefill`` (LiteRT-LM:
``prefill_<T>``) and ``decode``, and quantized by role. Prints quantized_roles, tflite_notes and moe_layers as JSON on
the last line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# TFLite op-name scopes per role (the converter names ops after the module path; fused ops append more paths
# after ';', so each pattern is anchored to the first segment)
ROLE_SCOPES: dict[str, str] = {
    "experts": r"^[^;]*DenseMaskedMoE_mlp/moetool\.export\.graph\.model\.GatedMLP_\d+/",
    "shared_expert": r"^[^;]*GatedMLP_shared/",
    "router": r"^[^;]*DenseMaskedMoE_mlp/torch\.nn\.modules\.linear\.Linear_(router|shared_gate)",
    "attention": r"^[^;]*Attention_attn/",
    "ffn": r"^[^;]*GatedMLP_mlp/",
    # the head's op is named after the logits it returns when they are a signature's output
    # (``output_0`` in moetool's chunk layout, ``logits`` in LiteRT-LM's, whose prefill signatures are ``prefill_<T>``)
    "output": r"^[^;]*Linear_lm_head|^(prefill\w*|decode)_(output_0|logits)_output(;|$)",
}


def role_precisions(precisions: dict[str, str]) -> dict[str, str]:
    """Per role, the one precision the plan gives it (TFLite configs go by scope, i.e. by role)."""
    from moetool.export.graph.names import hf_name
    from moetool.quant.roles import role_of

    out: dict[str, set[str]] = {}
    for name, p in precisions.items():
        out.setdefault(role_of(hf_name(name)), set()).add(p)
    mixed = {r: sorted(ps) for r, ps in out.items() if len(ps) > 1}
    if mixed:
        raise ValueError(f"TFLite quantization is configured per role; the plan mixes precisions within {mixed}")
    return {r: next(iter(ps)) for r, ps in out.items()}


def quantize(path: Path, roles: dict[str, str], blockwise: dict[str, bool]) -> dict[str, str]:
    """``blockwise[role]``: every input width of the role is a multiple of 32 (else int4 is per channel)."""
    from ai_edge_quantizer import qtyping, quantizer

    fc = qtyping.TFLOperationName.FULLY_CONNECTED
    q = quantizer.Quantizer(str(path))
    applied: dict[str, str] = {}
    for role, p in roles.items():
        if p == "fp32" or role not in ROLE_SCOPES:
            continue
        if p == "int4":
            gran = (
                qtyping.QuantGranularity.BLOCKWISE_32
                if blockwise.get(role, True)
                else qtyping.QuantGranularity.CHANNELWISE
            )
            q.add_dynamic_config(ROLE_SCOPES[role], fc, 4, gran)
            applied[role] = "int4" if blockwise.get(role, True) else "int4 (per channel)"
            continue
        q.add_dynamic_config(ROLE_SCOPES[role], fc, 8, qtyping.QuantGranularity.CHANNELWISE)
        applied[role] = p
    if applied:
        result = q.quantize()
        path.write_bytes(result.quantized_model)
    return applied


def _blockwise(model: Any, precisions: dict[str, str]) -> dict[str, bool]:
    """Per role: every quantized weight's input width is a multiple of 32 (int4 blocks of 32 fit)."""
    from moetool.export.graph.names import hf_name
    from moetool.quant.roles import role_of

    blockwise: dict[str, bool] = {}
    for n, prm in model.named_parameters(remove_duplicate=False):
        if prm.dim() == 2 and n in precisions:
            r = role_of(hf_name(n))
            blockwise[r] = blockwise.get(r, True) and prm.shape[1] % 32 == 0
    return blockwise


def _notes(roles: dict[str, str], applied: dict[str, str]) -> list[str]:
    notes = [
        f"{r} planned {p} but kept fp32 (only FULLY_CONNECTED ops are quantized for TFLite)"
        for r, p in roles.items()
        if p != "fp32" and r not in applied
    ]
    return notes + [
        f"{r}: an input width is not a multiple of 32, so int4 is per channel, not blockwise"
        for r, p in applied.items()
        if p.endswith("(per channel)")
    ]


def _convert_litertlm(chunk: Any, capacity: int, prefill_len: int, path: Path) -> None:
    """``chunk`` (every layer) converted to ``path`` in LiteRT-LM's layout
    (:class:`~moetool.export.tflite.litertlm.LiteRTLMModel`): ``prefill_<prefill_len>`` and ``decode``."""
    from moetool.export.tflite.litertlm import LiteRTLMModel, sample_inputs, stub_tensorflow_schema

    stub_tensorflow_schema()  # before litert_torch.generative is imported (by the model's forward)
    import litert_torch

    model = LiteRTLMModel(chunk, capacity).eval()
    pre, dec = sample_inputs(model, prefill_len), sample_inputs(model, 1, prefill_len)
    conv = litert_torch.signature(f"prefill_{prefill_len}", model, sample_kwargs=pre)
    edge = conv.signature("decode", model, sample_kwargs=dec).convert()
    edge.export(str(path))


def convert(req: dict[str, Any]) -> dict[str, Any]:
    """The request (module docstring) in, its ``.tflite`` written, the result out."""
    import litert_torch

    from moetool.export.graph.chunk import ExportChunk
    from moetool.export.graph.model import DenseMaskedMoE
    from moetool.export.graph.static import StaticCacheLM, static_mask
    from moetool.export.graph.stream import streamed_export_model

    src = streamed_export_model(Path(req["model_dir"]))
    start, stop = (int(i) for i in req["layers"])
    blocks = {i: src.block(i) for i in range(start, stop)}
    chunk = ExportChunk(src.em, blocks, first=bool(req["first"]), last=bool(req["last"])).eval()
    cap, plen = int(req["capacity"]), int(req["prefill_len"])
    path = Path(req["path"])
    if req.get("litertlm"):  # the whole model in one: LiteRT-LM's names and layout
        _convert_litertlm(chunk, cap, plen, path)
    else:
        model = StaticCacheLM(chunk, cap).eval()

        def first_input(t: int) -> torch.Tensor:
            return torch.zeros(1, t, dtype=torch.long) if chunk.first else torch.zeros(1, t, chunk.hidden_size)

        pos = torch.arange(plen)[None]
        pre_args = (first_input(plen), pos, static_mask(pos, cap), *model.empty_cache())
        one = torch.tensor([[plen]])
        dec_args = (first_input(1), one, static_mask(one, cap), *model.empty_cache())
        edge = litert_torch.signature("prefill", model, pre_args).signature("decode", model, dec_args).convert()
        edge.export(str(path))
        del edge
    held = {n for n, _ in chunk.named_parameters(remove_duplicate=False)}
    precisions = {n: p for n, p in req["precisions"].items() if n in held}  # this chunk's weights only
    roles = role_precisions(precisions)
    applied = quantize(path, roles, _blockwise(chunk, precisions))
    bundle = req.get("bundle")
    if bundle:
        from moetool.export.tflite.litertlm import write_bundle

        write_bundle(
            Path(bundle["path"]),
            path,
            Path(bundle["tokenizer"]),
            start_ids=list(bundle["start_ids"]),
            stop_ids=list(bundle["stop_ids"]),
            capacity=cap,
        )
    return {
        "quantized_roles": applied,
        "tflite_notes": _notes(roles, applied),
        "moe_layers": sum(isinstance(b.mlp, DenseMaskedMoE) for b in blocks.values()),
    }


if __name__ == "__main__":
    from moetool.export.worker import worker_main

    worker_main(convert)
