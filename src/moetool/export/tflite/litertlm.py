"""The LiteRT-LM layout of a one-model TFLite export, and the ``.litertlm`` bundle that carries it; used where
litert-torch is installed (:mod:`moetool.export.tflite.worker`).

LiteRT-LM 0.18 runs one decoder model (a bundle's PREFILL_DECODE section; a second one is silently ignored) and reads
it by name: signatures ``prefill_<T>`` and ``decode``; inputs ``tokens`` int32 ``[1, T]``, ``input_pos`` int32
``[T]`` (absolute positions), ``mask`` float32 ``[1, 1, T, C]`` and ``kv_cache_k_{i}``/``kv_cache_v_{i}`` float32
``[1, kv_heads, C, head_dim]``; outputs the updated caches under the same names and ``logits`` float32
``[1, T, V]``. moetool's own check in the LiteRT interpreter reads the same signatures
(:mod:`moetool.export.tflite.chain_worker`), so one conversion serves both.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from moetool.export.graph.chunk import ExportChunk

__all__ = ["LiteRTLMModel", "cache_names", "sample_inputs", "stub_tensorflow_schema", "write_bundle"]


def stub_tensorflow_schema() -> None:
    """Alias ``tensorflow.lite.python.schema_py_generated`` to ai_edge_litert's copy of the same flatbuffer schema.

    ``litert_torch.generative`` (its ``dynamic_update_slice`` op, the only cache write LiteRT-LM's padded prefill
    leaves exact) imports that one module of TensorFlow; this saves a 600 MB wheel. Call before importing it.
    """
    if "tensorflow" in sys.modules:
        return
    import importlib.machinery
    import types

    import torch._dynamo  # noqa: F401  (its trace rules find_spec() every 'tensorflow*' module: import it first)
    from ai_edge_litert import schema_py_generated

    names = ("tensorflow", "tensorflow.lite", "tensorflow.lite.python")
    mods = {n: types.ModuleType(n) for n in names}
    for n, m in mods.items():
        m.__path__ = []
        m.__spec__ = importlib.machinery.ModuleSpec(n, None, is_package=True)
    mods["tensorflow"].lite = mods["tensorflow.lite"]  # type: ignore[attr-defined]
    mods["tensorflow.lite"].python = mods["tensorflow.lite.python"]  # type: ignore[attr-defined]
    mods["tensorflow.lite.python"].schema_py_generated = schema_py_generated  # type: ignore[attr-defined]
    sys.modules.update(mods)
    sys.modules["tensorflow.lite.python.schema_py_generated"] = schema_py_generated


def cache_names(n_layers: int) -> list[str]:
    """The caches' input and output names, in the order moetool passes them on: ``kv_cache_k_0, kv_cache_v_0, …``."""
    return [f"kv_cache_{kv}_{i}" for i in range(n_layers) for kv in ("k", "v")]


class LiteRTLMModel(nn.Module):
    """A whole model (one :class:`~moetool.export.graph.chunk.ExportChunk` of every layer) in LiteRT-LM's layout
    (module docstring), with ``capacity`` cache slots.

    The new keys and values are written with TFLite's DYNAMIC_UPDATE_SLICE at ``input_pos[0]``: LiteRT-LM pads a
    short prefill to the signature's length and gives the padding positions of its own choosing, and a contiguous
    write from the first position keeps every real slot exact whatever they are (the padded slots are overwritten by
    later steps and hidden by the mask until then).
    """

    def __init__(self, model: ExportChunk, capacity: int) -> None:
        super().__init__()
        self.model = model
        self.capacity = capacity

    def forward(
        self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_cache: dict[str, torch.Tensor], mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        from litert_torch.generative.custom_ops.dynamic_update_slice import dynamic_update_slice

        from moetool.export.graph.model import Block, attend, qkv_rope

        m = self.model
        assert m.embed is not None and m.norm is not None and m.lm_head is not None  # a whole model
        zero = torch.zeros((), dtype=torch.int32)  # the op's start indices are 0-D int32 tensors
        at = [zero, zero, input_pos[0], zero]
        x = m.embed(tokens)
        cos, sin = m.rope(input_pos[None])
        out: dict[str, torch.Tensor] = {}
        blocks = [b for b in m.layers.values() if isinstance(b, Block)]
        for i, block in enumerate(blocks):
            a = block.attn
            q, k, v = qkv_rope(a, block.attn_norm(x), cos, sin)
            kc = dynamic_update_slice(kv_cache[f"k_{i}"], k, at)
            vc = dynamic_update_slice(kv_cache[f"v_{i}"], v, at)
            out[f"kv_cache_k_{i}"], out[f"kv_cache_v_{i}"] = kc, vc
            x = x + attend(a, q, kc, vc, mask)
            x = x + block.mlp(block.ffn_norm(x))
        out["logits"] = m.lm_head(m.norm(x))
        return out


def sample_inputs(model: LiteRTLMModel, t: int, start: int = 0) -> dict[str, Any]:
    """Keyword inputs of a ``t``-token signature (``kv_cache`` a dict: its keys become ``kv_cache_k_0`` …)."""
    from moetool.export.graph.static import static_mask

    m, cap = model.model, model.capacity
    pos = torch.arange(start, start + t, dtype=torch.int32)
    shape = (1, m.n_kv, cap, m.head_dim)
    kv = {f"{kv}_{i}": torch.zeros(shape) for i in range(m.n_layers) for kv in ("k", "v")}
    return {
        "tokens": torch.zeros(1, t, dtype=torch.int32),
        "input_pos": pos,
        "kv_cache": kv,
        "mask": static_mask(pos[None].long(), cap),
    }


def write_bundle(
    path: Path, tflite: Path, tokenizer: Path, *, start_ids: list[int], stop_ids: list[int], capacity: int
) -> None:
    """``path``: a ``.litertlm`` of the LLM metadata (start token, stop tokens, ``capacity`` tokens), the Hugging
    Face ``tokenizer`` and the ``tflite`` decoder model (LiteRT-LM's metadata validation on)."""
    import litert_lm_builder as lb
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    md = llm_metadata_pb2.LlmMetadata()
    if start_ids:  # the runtime puts it before the first prefill, as the model's tokenizer does in transformers
        md.start_token.token_ids.ids.extend(start_ids)
    for i in stop_ids:
        md.stop_tokens.add().token_ids.ids.append(i)
    md.max_num_tokens = capacity
    md.llm_model_type.generic_model.SetInParent()
    md.supports_thinking = False  # both required by the builder's validation
    md.supports_function_calling = False
    meta = path.with_name(path.name + ".metadata.pb")
    meta.write_bytes(md.SerializeToString())
    try:
        b = lb.LitertLmFileBuilder()
        b.add_system_metadata(lb.Metadata(key="Authors", value="moetool", dtype=lb.DType.STRING))
        b.add_llm_metadata(str(meta))
        b.add_hf_tokenizer(str(tokenizer))
        b.add_tflite_model(str(tflite), lb.TfLiteModelType.PREFILL_DECODE)
        with path.open("wb") as f:
            b.build(f, validate_metadata=True)
    finally:
        meta.unlink(missing_ok=True)
