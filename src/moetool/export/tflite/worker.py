"""The TFLite conversion itself, run where litert-torch is installed (an isolated venv: litert-torch pins
typing-extensions and pydantic below what the rest of moetool's stack needs).

    python -m moetool.export.tflite.worker REQUEST.json

REQUEST has model_dir, out_dir (an existing empty directory), precisions (export name → fp32|int8|int4),
capacity, prefill_len, verify, eval_text. Writes model.tflite and prints the result JSON on the last line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

# TFLite op-name scopes per role (the converter names ops after the module path; fused ops append more paths
# after ';', so each pattern is anchored to the first segment)
ROLE_SCOPES: dict[str, str] = {
    "experts": r"^[^;]*DenseMaskedMoE_mlp/moetool\.export\.graph\.model\.GatedMLP_\d+/",
    "shared_expert": r"^[^;]*GatedMLP_shared/",
    "router": r"^[^;]*DenseMaskedMoE_mlp/torch\.nn\.modules\.linear\.Linear_(router|shared_gate)",
    "attention": r"^[^;]*Attention_attn/",
    "ffn": r"^[^;]*GatedMLP_mlp/",
    "output": r"^[^;]*Linear_lm_head",
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


def _blockwise(em: Any, precisions: dict[str, str]) -> dict[str, bool]:
    """Per role: every quantized weight's input width is a multiple of 32 (int4 blocks of 32 fit)."""
    from moetool.export.graph.names import hf_name
    from moetool.quant.roles import role_of

    blockwise: dict[str, bool] = {}
    for n, prm in em.named_parameters():
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


def _parity(path: Path, hf: Any, em: Any, model: Any, req: dict[str, Any], cap: int, plen: int) -> dict[str, Any]:
    """The converted model's prefill and decode signatures in the LiteRT interpreter against transformers."""
    from ai_edge_litert.interpreter import Interpreter
    from transformers import AutoTokenizer

    from moetool.export.graph.parity import graph_parity
    from moetool.export.graph.static import static_mask
    from moetool.export.tflite.runner import signature_outputs

    it = Interpreter(model_path=str(path))
    pre, dec = it.get_signature_runner("prefill"), it.get_signature_runner("decode")
    n_cache = 2 * em.n_layers

    def run(
        runner: Any, ids: np.ndarray, p: np.ndarray, caches: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {
            "args_0": ids.astype(np.int32),
            "args_1": p.astype(np.int32),
            "args_2": static_mask(torch.from_numpy(p), cap).numpy(),
        }
        feeds |= {f"args_{3 + i}": c for i, c in enumerate(caches)}
        out = signature_outputs(runner, feeds)  # logits, then the caches
        return out[0], out[1 : 1 + n_cache]

    empty = [c.numpy() for c in model.empty_cache()]

    def prefill(ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        n = ids.shape[1]
        padded = np.zeros((1, plen), dtype=np.int64)
        padded[0, :n] = ids[0]
        logits, caches = run(pre, padded, np.arange(plen)[None], empty)
        return logits[:, :n], caches

    def decode(ids: np.ndarray, p: int, caches: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        return run(dec, ids, np.array([[p]]), caches)

    tok = AutoTokenizer.from_pretrained(req["model_dir"])
    return graph_parity(
        hf, em, tok, req["eval_text"], prefill, decode, runtime="ai_edge_litert interpreter", seq_lens=(32, plen)
    )


def convert(req: dict[str, Any]) -> dict[str, Any]:
    """The request (module docstring) in, model.tflite written, the result out."""
    import litert_torch
    from litert_torch import signature  # noqa: F401  (import check: the venv must have litert-torch)

    from moetool.export.graph.model import load_export_model
    from moetool.export.graph.moe_kernel import dense_moe_kernel
    from moetool.export.graph.static import StaticCacheLM, static_mask

    hf, em = load_export_model(req["model_dir"])
    cap, plen = int(req["capacity"]), int(req["prefill_len"])
    model = StaticCacheLM(em, cap).eval()
    pos = torch.arange(plen)[None]
    pre_args = (torch.zeros(1, plen, dtype=torch.long), pos, static_mask(pos, cap), *model.empty_cache())
    one = torch.tensor([[plen]])
    dec_args = (torch.zeros(1, 1, dtype=torch.long), one, static_mask(one, cap), *model.empty_cache())
    edge = litert_torch.signature("prefill", model, pre_args).signature("decode", model, dec_args).convert()
    path = Path(req["out_dir"]) / "model.tflite"
    edge.export(str(path))
    roles = role_precisions(req["precisions"])
    applied = quantize(path, roles, _blockwise(em, req["precisions"]))
    result: dict[str, Any] = {
        "quantized_roles": applied,
        "capacity": cap,
        "prefill_len": plen,
        "tflite_notes": _notes(roles, applied),
        "cache_shape": [1, em.n_kv, cap, em.head_dim],
        "cache_tensors": 2 * em.n_layers,
        "moe_kernel": dense_moe_kernel("tflite", em.moe_layers()),
    }
    if req["verify"]:
        result["parity"] = _parity(path, hf, em, model, req, cap, plen)
    return result


if __name__ == "__main__":
    from moetool.export.tflite.runner import worker_main

    worker_main(convert)
