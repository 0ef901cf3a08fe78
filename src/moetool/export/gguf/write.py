"""Write a GGUF file tensor by tensor (streamed), each in the type its plan assigns.

Types gguf-py can quantize are written directly; K and IQ types, and with an importance matrix every type llama.cpp
rounds with one, are written f32 first and then requantized by llama.cpp's own quantizer (``llama_model_quantize``
with one exact-name override per tensor and the importance matrix passed as its C array), so every byte of those
tensors comes from llama.cpp.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from moetool.export.base import ExportError
from moetool.export.gguf.layout import GGUFTensor, Layout
from moetool.export.gguf.names import permute_qk
from moetool.export.gguf.rope import plan_rope, write_rope_metadata
from moetool.export.gguf.scales import write_scales
from moetool.export.gguf.tokenizer import GGUFVocab, write_vocab
from moetool.export.gguf.verify import quiet_stderr
from moetool.export.jsonnum import integer, number
from moetool.extras import require
from moetool.io.checkpoint import Checkpoint
from moetool.io.jsontypes import JsonValue
from moetool.quant.imatrix import ImatrixError, ImportanceMatrix
from moetool.quant.plan import QuantPlan
from moetool.quant.types import IMATRIX_AWARE, TYPES

if TYPE_CHECKING:
    import ctypes

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


def by_llama_cpp(plan: QuantPlan, with_imatrix: bool) -> dict[str, str]:
    """GGUF name → type of the tensors llama.cpp's quantizer writes: every type gguf-py cannot write, and with an
    importance matrix every type llama.cpp rounds with it (gguf-py's quantizers take none)."""
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
    llama: Collection[str] = (),
) -> None:
    """Write ``path``; the tensors named in ``llama`` are written f32, for :func:`requantize` to quantize."""
    import gguf

    types = {a.entry.out_name: a.type for a in plan.assignments}
    staged = set(llama)
    w = gguf.GGUFWriter(str(path), layout.arch)
    _metadata(w, cfg, layout, name, file_type_of(plan))
    write_vocab(w, vocab)
    for t in layout.tensors:
        ty = "f32" if t.name in staged else types[t.name]
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
        ty = "f32" if t.name in staged else types[t.name]
        arr = rope_tensors[t.name] if t.name in rope_tensors else load_tensor(ckpt, t)
        data, _ = encode(arr, ty)
        w.write_tensor_data(data)
        if progress is not None:
            progress()
    w.close()


def imatrix_array(
    llama_cpp: ModuleType, imatrix: ImportanceMatrix, shapes: dict[str, tuple[int, ...]]
) -> tuple[ctypes.Array[ctypes.Structure], list[object]]:
    """llama.cpp's ``llama_model_imatrix_data`` array (NULL-terminated) for the tensors in ``shapes`` (GGUF name →
    torch shape), and the buffers that must outlive the call.

    Raises:
        ImatrixError: a tensor's statistics do not match its shape (an importance matrix of another model).
    """
    import ctypes

    Entry = llama_cpp.llama_model_imatrix_data
    items = []
    for name, shape in shapes.items():
        e = imatrix.entries.get(name)
        if e is None:
            continue
        n_mat = shape[0] if len(shape) == 3 else 1
        if e.sums.shape != (n_mat, shape[-1]):
            raise ImatrixError(
                f"the importance matrix's {name} has {e.sums.shape[0]} × {e.sums.shape[1]} values; the tensor needs "
                f"{n_mat} × {shape[-1]} (was it collected on another model?)"
            )
        items.append((name, e.values()))
    arr: ctypes.Array[ctypes.Structure] = (Entry * (len(items) + 1))()
    keep: list[object] = []
    for i, (name, values) in enumerate(items):
        key = name.encode()
        keep += [key, values]
        arr[i].name = key
        arr[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        arr[i].size = values.size
    arr[len(items)].name = None
    return arr, keep


def requantize(
    src: Path, dst: Path, plan: QuantPlan, *, imatrix: ImportanceMatrix | None = None, threads: int = 0
) -> None:
    """Let llama.cpp quantize the tensors of ``src`` that :func:`by_llama_cpp` names (written f32) into ``dst``, with
    ``imatrix``'s importance where given; all others are copied.

    Raises:
        MissingExtraError: llama-cpp-python is missing.
        ImatrixError: ``imatrix`` does not fit the model.
        ExportError: llama.cpp's quantizer failed.
    """
    import ctypes

    llama_cpp = require(
        "llama_cpp",
        "llama",
        why="writing K and IQ types, or any type with an importance matrix, with llama.cpp's quantizer",
        otherwise="choose a plan of f16/bf16/q8_0/q5_x/q4_x types",
    )
    Override = llama_cpp.llama_model_tensor_override
    names = [(a.entry.out_name or a.entry.hf_name, a.type) for a in plan.assignments if len(a.entry.shape) >= 2]
    arr = (Override * (len(names) + 1))()
    keep: list[object] = []  # buffers the C call reads: alive until it returns
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
    if imatrix is not None:
        wanted = by_llama_cpp(plan, True)
        shapes = {(a.entry.out_name or a.entry.hf_name): a.entry.shape for a in plan.assignments}
        im_arr, im_keep = imatrix_array(llama_cpp, imatrix, {n: shapes[n] for n in wanted})
        keep += [im_arr, *im_keep]
        params.imatrix = ctypes.cast(im_arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))

    with quiet_stderr():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ExportError(f"llama.cpp's quantizer failed on {src} (return code {rc})")
