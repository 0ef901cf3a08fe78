"""Write a GGUF file tensor by tensor (streamed), each in the type its plan assigns.

Types gguf-py can quantize are written directly; K types are written f32 first and then requantized by llama.cpp's
own quantizer (``llama_model_quantize`` with one exact-name override per tensor), so every byte of a K-quant comes
from llama.cpp.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from moetool.export.base import ExportError
from moetool.export.gguf.layout import GGUFTensor, Layout
from moetool.export.gguf.names import permute_qk
from moetool.export.gguf.rope import plan_rope, write_rope_metadata
from moetool.export.gguf.scales import write_scales
from moetool.export.gguf.tokenizer import GGUFVocab, write_vocab
from moetool.export.gguf.verify import quiet_stderr
from moetool.extras import require
from moetool.io.checkpoint import Checkpoint
from moetool.quant.plan import QuantPlan
from moetool.quant.types import TYPES

SHEXP_GATE_EPS = 1e-20
# label for general.file_type: the type holding most of the weights
_FILE_TYPE = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q8_0": 7,
    "q5_0": 8,
    "q5_1": 9,
    "q2_k": 10,
    "q3_k": 11,
    "q4_k": 15,
    "q5_k": 17,
    "q6_k": 18,
    "bf16": 32,
}


def _ggml(name: str) -> Any:
    import gguf

    return getattr(gguf.GGMLQuantizationType, name.upper())


def load_tensor(ckpt: Checkpoint, t: GGUFTensor) -> np.ndarray:
    """The tensor as float32 numpy in torch order, stacked, permuted and squeezed as the layout says."""
    if t.zeros:
        arr = np.zeros(t.shape, dtype=np.float32)
        return np.full(t.shape, SHEXP_GATE_EPS, dtype=np.float32) if t.name.endswith("gate_inp_shexp.weight") else arr
    parts = [ckpt.get(s).float().numpy() for s in t.sources]
    arr = np.stack(parts) if len(parts) > 1 else parts[0]
    if t.rows is not None:
        arr = arr[..., t.rows[0] : t.rows[1], :]
    if t.permute_heads:
        arr = permute_qk(arr, t.permute_heads)
    if t.squeeze:
        arr = arr.reshape(-1)
    if t.name.endswith("ffn_gate_inp_shexp.weight") and not np.any(arr):
        # llama.cpp computes the shared-expert sigmoid as silu(x)/x, NaN at x = 0; a 1e-20 gate still gives 0.5
        arr = np.full(arr.shape, SHEXP_GATE_EPS, dtype=np.float32)
    return np.ascontiguousarray(arr, dtype=np.float32)


def encode(arr: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """Bytes of ``arr`` in ``type_name`` (gguf-py's quantizers), and the GGML type to declare."""
    import gguf

    if type_name == "f32":
        return arr, None
    if type_name == "f16":
        return arr.astype(np.float16), None
    q = gguf.quants.quantize(arr, _ggml(type_name))
    return np.ascontiguousarray(q).view(np.uint8), _ggml(type_name)


def _metadata(w: Any, cfg: dict[str, Any], layout: Layout, name: str, file_type: int) -> None:
    import gguf

    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rope = cfg.get("rope_parameters") or {}
    w.add_name(name)
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(hidden)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or heads))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    write_rope_metadata(w, plan_rope(cfg, layout.arch))
    write_scales(w, cfg, layout.llama_cpp)
    w.add_rope_dimension_count(head_dim)
    if head_dim * heads != hidden:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if layout.n_experts:
        w.add_expert_count(layout.n_experts)
        w.add_expert_used_count(layout.top_k)
        if layout.llama_cpp.expert_ff_key and layout.expert_ff:
            w.add_expert_feed_forward_length(layout.expert_ff)
        if layout.llama_cpp.shared_expert and layout.shared_ff:
            w.add_expert_shared_feed_forward_length(layout.shared_ff)


def file_type_of(plan: QuantPlan) -> int:
    by_type: Counter[str] = Counter()
    for a in plan.assignments:
        if len(a.entry.shape) >= 2:
            by_type[a.type] += a.params
    return _FILE_TYPE.get(by_type.most_common(1)[0][0], 0) if by_type else 0


def write_gguf(
    path: Path,
    *,
    ckpt: Checkpoint,
    cfg: dict[str, Any],
    layout: Layout,
    plan: QuantPlan,
    vocab: GGUFVocab,
    name: str,
    progress: Any = None,
) -> None:
    """Write ``path``; K-type tensors are requantized afterwards by :func:`requantize_k`."""
    import gguf

    types = {a.entry.out_name: a.type for a in plan.assignments}
    k_types = {n: t for n, t in types.items() if not TYPES[t].python}
    w = gguf.GGUFWriter(str(path), layout.arch)
    _metadata(w, cfg, layout, name, file_type_of(plan))
    write_vocab(w, vocab)
    for t in layout.tensors:
        ty = "f32" if t.name in k_types else types[t.name]
        spec = TYPES[ty]
        if ty in ("f32", "f16"):
            dt = np.float32 if ty == "f32" else np.float16
            w.add_tensor_info(t.name, t.shape, np.dtype(dt), spec.nbytes(t.shape))
        else:
            byte_shape = (*t.shape[:-1], t.shape[-1] // spec.block * spec.block_bytes)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), spec.nbytes(t.shape), raw_dtype=_ggml(ty))
    rope_tensors = plan_rope(cfg, layout.arch).tensors
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in layout.tensors:
        ty = "f32" if t.name in k_types else types[t.name]
        arr = rope_tensors[t.name] if t.name in rope_tensors else load_tensor(ckpt, t)
        data, _ = encode(arr, ty)
        w.write_tensor_data(data)
        if progress is not None:
            progress()
    w.close()


def requantize_k(src: Path, dst: Path, plan: QuantPlan, threads: int = 0) -> None:
    """Let llama.cpp quantize the K-type tensors of ``src`` (written f32) into ``dst``; all others are copied.

    Raises:
        MissingExtraError: llama-cpp-python is missing.
        ExportError: llama.cpp's quantizer failed.
    """
    import ctypes

    llama_cpp = require(
        "llama_cpp",
        "llama",
        why="writing K-quant types (q2_k … q6_k) with llama.cpp's quantizer",
        otherwise="choose a plan of f16/bf16/q8_0/q5_x/q4_x types",
    )
    Override = llama_cpp.llama_model_tensor_override
    names = [(a.entry.out_name or a.entry.hf_name, a.type) for a in plan.assignments if len(a.entry.shape) >= 2]
    arr = (Override * (len(names) + 1))()
    keep: list[bytes] = []
    for i, (n, ty) in enumerate(names):
        pat = ("^" + n.replace(".", r"\.") + "$").encode()
        keep.append(pat)
        arr[i].pattern = pat
        arr[i].type = int(_ggml(ty))
    arr[len(names)].pattern = None
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = 7  # MOSTLY_Q8_0: only a label here, every 2-D tensor has an override
    params.pure = True
    params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(Override))

    with quiet_stderr():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ExportError(f"llama.cpp's quantizer failed on {src} (return code {rc})")
