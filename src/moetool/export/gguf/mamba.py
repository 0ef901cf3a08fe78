"""Mamba (``MambaForCausalLM``) → GGUF for llama.cpp's ``mamba`` architecture, verified with llama-cpp-python.

The name map and tensor transforms are data (below), following llama.cpp's own converter: ``A_log`` is stored as
``A = −exp(A_log)``, the depthwise conv weight ``[D, 1, K]`` as ``[D, K]``, a tied ``lm_head`` is omitted, and the
SSM's small tensors (conv, x/dt projections, A, D) stay f32 whatever the chosen type (llama.cpp requires it).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from moetool.export.base import ExportError, write_manifest
from moetool.export.gate import margin_gate
from moetool.export.gguf.tokenizer import read_vocab, write_vocab
from moetool.export.gguf.verify import run_llama
from moetool.export.heldout import held_out_text
from moetool.export.parity import NOT_VERIFIED, ParityRecord, TokenizerCheck
from moetool.io.atomic import atomic_dir
from moetool.io.jsontypes import JsonObject
from moetool.io.safe import read_json

if TYPE_CHECKING:
    import torch

ARCH = "mamba"
# HF name → GGUF name, outside the layer stack
_GLOBAL = {
    "backbone.embeddings.weight": "token_embd.weight",
    "backbone.norm_f.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# a layer's HF name after ``backbone.layers.{i}.`` → its GGUF name after ``blk.{i}.``
_LAYER = {
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.x_proj.weight": "ssm_x.weight",
    "mixer.dt_proj.weight": "ssm_dt.weight",
    "mixer.dt_proj.bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.out_proj.weight": "ssm_out.weight",
}
# a layer's HF name (as in _LAYER) → how its tensor is written; every other tensor as it is
_TRANSFORM = {"mixer.conv1d.weight": "squeeze", "mixer.A_log": "neg_exp"}
_LAYER_NAME = re.compile(r"backbone\.layers\.(\d+)\.(.+)")
# tensors that may be stored f16 (everything else stays f32)
F16_OK = re.compile(r"^(token_embd|output|blk\.\d+\.ssm_in|blk\.\d+\.ssm_out)\.weight$")


class MambaWritten(TypedDict):
    """What :func:`write_mamba_gguf` wrote: the tensor count and each tensor's type (f32 or f16)."""

    tensors: int
    types: dict[str, str]


def gguf_tensors(state: dict[str, torch.Tensor], tied: bool) -> list[tuple[str, np.ndarray]]:
    """HF state dict → [(GGUF name, float32 array)] in file order.

    Raises:
        ExportError: a tensor the map does not know (so nothing is silently dropped).
    """
    out = []
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        name, transform = _map(hf_name)
        arr = t.float().numpy()
        if transform == "neg_exp":
            arr = -np.exp(arr)
        elif transform == "squeeze":
            arr = arr.reshape(arr.shape[0], arr.shape[-1])
        out.append((name, np.ascontiguousarray(arr, dtype=np.float32)))
    return out


def _map(hf_name: str) -> tuple[str, str]:
    m = _LAYER_NAME.fullmatch(hf_name)
    if m and m[2] in _LAYER:
        return f"blk.{m[1]}.{_LAYER[m[2]]}", _TRANSFORM.get(m[2], "none")
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name], "none"
    raise ExportError(f"Mamba GGUF: no GGUF name for tensor {hf_name!r}")


def write_mamba_gguf(model_dir: Path, path: Path, *, quant: str = "f32") -> MambaWritten:
    """Write ``path`` from the ``MambaForCausalLM`` in ``model_dir``; returns the tensor count and types."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    if quant not in ("f32", "f16"):
        raise ExportError(f"Mamba GGUF: quant {quant!r} is not supported (f32 or f16)")
    cfg = read_json(model_dir / "config.json", what="model config", error=ExportError)
    if cfg.get("model_type") != "mamba":
        raise ExportError(f"{model_dir}: model_type {cfg.get('model_type')!r} is not mamba")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tied = bool(cfg.get("tie_word_embeddings", True))
    tensors = gguf_tensors(model.state_dict(), tied)
    hidden = int(cfg["hidden_size"])
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(model_dir.resolve().name)
    w.add_context_length(1 << 20)  # recurrent: no positional limit (llama.cpp's converter writes the same)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_ssm_conv_kernel(int(cfg.get("conv_kernel", 4)))
    w.add_ssm_inner_size(int(cfg.get("intermediate_size") or cfg.get("expand", 2) * hidden))
    w.add_ssm_state_size(int(cfg.get("state_size", 16)))
    w.add_ssm_time_step_rank(int(cfg.get("time_step_rank") or -(hidden // -16)))
    w.add_layer_norm_rms_eps(float(cfg.get("layer_norm_epsilon", 1e-5)))
    w.add_ssm_dt_b_c_rms(False)
    w.add_file_type(1 if quant == "f16" else 0)
    write_vocab(w, read_vocab(model_dir, int(cfg["vocab_size"])))
    types = {}
    for name, arr in tensors:
        data = arr.astype(np.float16) if quant == "f16" and F16_OK.match(name) else arr
        types[name] = "f16" if data.dtype == np.float16 else "f32"
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"tensors": len(tensors), "types": types}


def verify_mamba_gguf(
    path: Path, model_dir: Path, text: str, seq_lens: tuple[int, ...] = (32, 128), quant: str = "f32"
) -> ParityRecord:
    """llama.cpp (llama-cpp-python) against transformers on the same ids: tokenizer, logits, perplexity, and the
    margin gate (:mod:`moetool.export.gate`) for a ``quant`` file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    run = run_llama(path, tok, text, list(seq_lens))
    mismatches = run.tokenizer_mismatches
    logits = run.transformers_logits(ref)
    agree = run.against(logits)
    n = len(run.probes)
    # the weights are the source's rounded to f16 at most, within the float floor: no dequantized run is needed
    gate = margin_gate(logits[n:], None, run.logits[n:], {quant})
    record = ParityRecord(
        runtime="llama-cpp-python",
        reference="transformers float32 (MambaForCausalLM)",
        tokenizer=TokenizerCheck(match=not mismatches, mismatches=tuple(mismatches)),
        seq_lens=tuple(seq_lens),
        gate=gate,
    )
    return record.with_figures(agree)


def export_mamba_gguf(
    model_dir: Path,
    output: Path,
    *,
    quant: str = "f32",
    verify: bool = True,
    force: bool = True,
    text: str | None = None,
) -> JsonObject:
    """Write ``output/model.gguf`` + manifest.json; with ``verify``, parity in llama.cpp is recorded and gated.

    Raises:
        ExportError: an unknown tensor, or parity fails (the tokenizer differs, or the margin gate fails: top-1
            agreement where rounding cannot decide it, mean KL under the float bound).
    """

    model_dir = Path(model_dir)
    with atomic_dir(Path(output), force=force) as tmp:
        info = write_mamba_gguf(model_dir, tmp / "model.gguf", quant=quant)
        parity: ParityRecord | str = NOT_VERIFIED
        if verify:
            sample, source = held_out_text(model_dir, text)
            parity = verify_mamba_gguf(tmp / "model.gguf", model_dir, sample, quant=quant).judged(None)
            parity = replace(parity, text=source)
            if parity.tokenizer is None or not parity.tokenizer.match or parity.outcome != "pass":
                raise ExportError(f"Mamba GGUF parity failed: {parity.to_json()}")
        manifest: JsonObject = {
            "format": "gguf",
            "arch": ARCH,
            "file": "model.gguf",
            "source": str(model_dir),
            "quant": quant,
            "tensors": info["tensors"],
            "artifact": {"bytes": (tmp / "model.gguf").stat().st_size},
            "parity": parity.to_json() if isinstance(parity, ParityRecord) else parity,
        }
        write_manifest(tmp, manifest)
    return manifest
