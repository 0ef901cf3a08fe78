"""Write a GGUF file tensor by tensor (streamed), each in the type its plan assigns.

Types gguf-py can quantize are written by gguf-py; K and IQ types, and with an importance matrix every type
llama.cpp rounds with one, by ggml's own row quantizer (``ggml_quantize_chunk`` in the ``libggml-base`` that
llama-cpp-python ships: :mod:`moetool.export.gguf.ggml`), one matrix at a time with that matrix's importance, as
``llama-quantize`` calls it. So every byte of those tensors is llama.cpp's, and no float32 copy of the model is ever
written first (a 24B-parameter MoE would need 97 GB of disk for one).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moetool.export.gguf.layout import GGUFTensor, Layout
from moetool.export.gguf.names import permute_qk
from moetool.export.gguf.rope import plan_rope, write_rope_metadata
from moetool.export.gguf.scales import write_scales
from moetool.export.gguf.tokenizer import GGUFVocab, write_vocab
from moetool.export.jsonnum import integer, number
from moetool.io.checkpoint import Checkpoint
from moetool.io.jsontypes import JsonValue
from moetool.quant.imatrix import ImatrixError, ImportanceMatrix
from moetool.quant.plan import QuantPlan
from moetool.quant.types import IMATRIX_AWARE, TYPES

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, GGUFWriter

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
    "iq2_xxs": 19,
    "iq2_xs": 20,
    "iq3_xxs": 23,
    "iq4_nl": 25,
    "iq3_s": 26,
    "iq2_s": 28,
    "iq4_xs": 30,
    "bf16": 32,
}


def by_ggml(plan: QuantPlan, with_imatrix: bool) -> dict[str, str]:
    """GGUF name → type of the tensors ggml's quantizer writes: every type gguf-py cannot write, and with an importance
    matrix every type llama.cpp rounds with it (gguf-py's quantizers take none)."""
    out = {}
    for a in plan.assignments:
        if len(a.entry.shape) < 2:
            continue
        if not TYPES[a.type].python or (with_imatrix and a.type in IMATRIX_AWARE):
            out[a.entry.out_name or a.entry.hf_name] = a.type
    return out


def _ggml(name: str) -> GGMLQuantizationType:
    import gguf

    return gguf.GGMLQuantizationType[name.upper()]


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


def encode(arr: np.ndarray, type_name: str) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """Bytes of ``arr`` in ``type_name`` (gguf-py's quantizers), and the GGML type to declare."""
    import gguf

    if type_name == "f32":
        return arr, None
    if type_name == "f16":
        return arr.astype(np.float16), None
    q = gguf.quants.quantize(arr, _ggml(type_name))
    return np.ascontiguousarray(q).view(np.uint8), _ggml(type_name)


def encode_ggml(arr: np.ndarray, type_name: str, importance: np.ndarray | None, threads: int) -> np.ndarray:
    """Bytes of ``arr`` (``[rows, n_per_row]`` or ``[n_mat, rows, n_per_row]``) in ``type_name`` by ggml's quantizer,
    each matrix rounded with its row of ``importance`` (``[n_mat, n_per_row]``) where given."""
    from moetool.export.gguf.ggml import quantize_rows

    mats = arr.reshape(-1, *arr.shape[-2:])
    parts = [
        quantize_rows(m, type_name, None if importance is None else importance[i], threads=threads)
        for i, m in enumerate(mats)
    ]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _metadata(w: GGUFWriter, cfg: Mapping[str, JsonValue], layout: Layout, name: str, file_type: int) -> None:
    import gguf

    heads = integer(cfg["num_attention_heads"], "num_attention_heads")
    hidden = integer(cfg["hidden_size"], "hidden_size")
    head_dim = integer(cfg.get("head_dim") or hidden // heads, "head_dim")
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0)) if isinstance(rope, dict) else None
    w.add_name(name)
    w.add_context_length(integer(cfg.get("max_position_embeddings", 2048), "max_position_embeddings"))
    w.add_embedding_length(hidden)
    w.add_block_count(integer(cfg["num_hidden_layers"], "num_hidden_layers"))
    w.add_feed_forward_length(integer(cfg["intermediate_size"], "intermediate_size"))
    w.add_head_count(heads)
    w.add_head_count_kv(integer(cfg.get("num_key_value_heads") or heads, "num_key_value_heads"))
    w.add_layer_norm_rms_eps(number(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"))
    w.add_rope_freq_base(number(theta, "rope_parameters.rope_theta"))
    write_rope_metadata(w, plan_rope(cfg, layout.arch))
    write_scales(w, cfg, layout.llama_cpp)
    w.add_rope_dimension_count(head_dim)
    if head_dim * heads != hidden:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(integer(cfg["vocab_size"], "vocab_size"))
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
    cfg: Mapping[str, JsonValue],
    layout: Layout,
    plan: QuantPlan,
    vocab: GGUFVocab,
    name: str,
    progress: Callable[[], object] | None = None,
    imatrix: ImportanceMatrix | None = None,
    threads: int | None = None,
) -> None:
    """Write ``path`` one tensor at a time: memory holds one tensor in float32 and its bytes. The tensors
    :func:`by_ggml` names go through ggml's quantizer on ``threads`` threads (default: the CPU count, at most 4),
    rounded with ``imatrix``'s importance where it has the tensor.

    Raises:
        MissingExtraError: the plan needs ggml's quantizer and llama-cpp-python is missing.
        ImatrixError: ``imatrix`` does not fit the model.
    """
    import gguf

    types = {a.entry.out_name: a.type for a in plan.assignments}
    ggml_types = by_ggml(plan, imatrix is not None)
    threads = threads or max(1, min(4, os.cpu_count() or 1))
    w = gguf.GGUFWriter(str(path), layout.arch)
    _metadata(w, cfg, layout, name, file_type_of(plan))
    write_vocab(w, vocab)
    for t in layout.tensors:
        spec = TYPES[types[t.name]]
        if types[t.name] in ("f32", "f16"):
            dt = np.float32 if types[t.name] == "f32" else np.float16
            w.add_tensor_info(t.name, t.shape, np.dtype(dt), spec.nbytes(t.shape))
        else:
            byte_shape = (*t.shape[:-1], t.shape[-1] // spec.block * spec.block_bytes)
            w.add_tensor_info(
                t.name, byte_shape, np.dtype(np.uint8), spec.nbytes(t.shape), raw_dtype=_ggml(types[t.name])
            )
    rope_tensors = plan_rope(cfg, layout.arch).tensors
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in layout.tensors:
        ty = types[t.name]
        arr = rope_tensors[t.name] if t.name in rope_tensors else load_tensor(ckpt, t)
        if t.name in ggml_types:
            importance = None
            if imatrix is not None and ty in IMATRIX_AWARE:
                importance = importance_of(imatrix, t.name, tuple(t.shape))
            data = encode_ggml(arr, ty, importance, threads)
        else:
            data, _ = encode(arr, ty)
        del arr
        w.write_tensor_data(data)
        if progress is not None:
            progress()
    w.close()


def importance_of(imatrix: ImportanceMatrix, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """``[n_mat, n_per_row]`` float32 importance of tensor ``name`` (torch ``shape``: ``[n_mat, rows, n_per_row]`` or
    ``[rows, n_per_row]``) as llama.cpp's quantizer reads it, or None when the matrix has no statistics.

    Raises:
        ImatrixError: the statistics do not match the shape (an importance matrix of another model).
    """
    e = imatrix.entries.get(name)
    if e is None:
        return None
    n_mat = shape[0] if len(shape) == 3 else 1
    if e.sums.shape != (n_mat, shape[-1]):
        raise ImatrixError(
            f"the importance matrix's {name} has {e.sums.shape[0]} × {e.sums.shape[1]} values; the tensor needs "
            f"{n_mat} × {shape[-1]} (was it collected on another model?)"
        )
    return e.values().reshape(n_mat, shape[-1])
