"""ExportLM parameter names → Hugging Face names (data), so plans match roles and globs as for GGUF."""

from __future__ import annotations

import re

from moetool.quant.plan import TensorEntry

NAME_MAP: tuple[tuple[str, str], ...] = (
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.([qkvo])\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"layers\.(\d+)\.attn\.([qk])_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"layers\.(\d+)\.mlp\.router\.weight", r"model.layers.\1.mlp.gate.weight"),
    (r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", r"model.layers.\1.mlp.experts.\2.\3.weight"),
    (r"layers\.(\d+)\.mlp\.shared\.(\w+)\.weight", r"model.layers.\1.mlp.shared_expert.\2.weight"),
    (r"layers\.(\d+)\.mlp\.shared_gate\.weight", r"model.layers.\1.mlp.shared_expert_gate.weight"),
    (r"layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", r"model.layers.\1.mlp.\2.weight"),
)
_COMPILED = [(re.compile(p), r) for p, r in NAME_MAP]


def hf_name(export_name: str) -> str:
    for pat, repl in _COMPILED:
        if pat.fullmatch(export_name):
            return pat.sub(repl, export_name)
    raise ValueError(f"no Hugging Face name for export parameter {export_name!r}")


def plan_entries(model: object) -> list[TensorEntry]:
    """One entry per parameter of an ExportLM (``out_name`` is the export name)."""
    import torch

    assert isinstance(model, torch.nn.Module)
    return [TensorEntry(hf_name(n), tuple(p.shape), n) for n, p in model.named_parameters()]
