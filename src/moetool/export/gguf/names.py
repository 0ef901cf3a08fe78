"""Hugging Face tensor names → GGUF tensor names, and model_type → llama.cpp architecture (data)."""

from __future__ import annotations

import re
from typing import Any

# (HF regex, GGUF template). {i} is the layer; expert tensors carry their expert index in group 'e' and are
# stacked into one 3-D tensor per layer.
TENSOR_MAP: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(?P<i>\d+)\.input_layernorm\.weight", "blk.{i}.attn_norm.weight"),
    (r"model\.layers\.(?P<i>\d+)\.post_attention_layernorm\.weight", "blk.{i}.ffn_norm.weight"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.q_proj\.(?P<k>weight|bias)", "blk.{i}.attn_q.{k}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.k_proj\.(?P<k>weight|bias)", "blk.{i}.attn_k.{k}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.v_proj\.(?P<k>weight|bias)", "blk.{i}.attn_v.{k}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.o_proj\.(?P<k>weight|bias)", "blk.{i}.attn_output.{k}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.q_norm\.weight", "blk.{i}.attn_q_norm.weight"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.k_norm\.weight", "blk.{i}.attn_k_norm.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.gate_proj\.weight", "blk.{i}.ffn_gate.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.up_proj\.weight", "blk.{i}.ffn_up.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.down_proj\.weight", "blk.{i}.ffn_down.weight"),
    (r"model\.layers\.(?P<i>\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight", "blk.{i}.ffn_gate_inp.weight"),
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.w1\.weight", "blk.{i}.ffn_gate_exps.weight"),
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.w2\.weight", "blk.{i}.ffn_down_exps.weight"),
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.w3\.weight", "blk.{i}.ffn_up_exps.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\.gate_proj\.weight", "blk.{i}.ffn_gate_exps.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\.up_proj\.weight", "blk.{i}.ffn_up_exps.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.(?P<e>\d+)\.down_proj\.weight", "blk.{i}.ffn_down_exps.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.shared_expert\.gate_proj\.weight", "blk.{i}.ffn_gate_shexp.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.shared_expert\.up_proj\.weight", "blk.{i}.ffn_up_shexp.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.shared_expert\.down_proj\.weight", "blk.{i}.ffn_down_shexp.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.shared_expert_gate\.weight", "blk.{i}.ffn_gate_inp_shexp.weight"),
    # GraniteMoE: its router, and the down projections of every expert already stacked [E, H, I]
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.router\.layer\.weight", "blk.{i}.ffn_gate_inp.weight"),
    (r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.output_linear\.weight", "blk.{i}.ffn_down_exps.weight"),
)
# (HF regex, GGUF templates): a stacked tensor whose rows (dim -2) are the GGUF tensors in equal parts, in order
SPLIT_MAP: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.input_linear\.weight",
        ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
    ),
)
_SPLIT = [(re.compile(p), t) for p, t in SPLIT_MAP]
_COMPILED = [(re.compile(p), t) for p, t in TENSOR_MAP]

# model_type → (llama.cpp arch, Q/K need the NORM-rope permutation)
ARCHS: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True),
    "mistral": ("llama", True),
    "mixtral": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "qwen2_moe": ("qwen2moe", False),
    "qwen3_moe": ("qwen3moe", False),
    "granite": ("granite", True),
    "granitemoe": ("granitemoe", True),
}


def gguf_name(hf_name: str) -> tuple[str, int | None] | None:
    """GGUF name and expert index (for stacked expert tensors) of an HF tensor; None if it has no GGUF place."""
    for pat, tmpl in _COMPILED:
        m = pat.fullmatch(hf_name)
        if m:
            g = m.groupdict()
            e = g.pop("e", None)
            return tmpl.format(**{k: v for k, v in g.items() if v is not None}), None if e is None else int(e)
    return None


def split_names(hf_name: str) -> tuple[str, ...]:
    """The GGUF tensors an HF tensor splits into along its rows (see ``SPLIT_MAP``); empty if it is not split."""
    for pat, templates in _SPLIT:
        m = pat.fullmatch(hf_name)
        if m:
            return tuple(t.format(**m.groupdict()) for t in templates)
    return ()


def permute_qk(w: Any, n_head: int) -> Any:
    """HF's rotate-half Q/K rows → the interleaved order of llama.cpp's NORM rope (as llama.cpp's converter).

    ``w``: [n_head·head_dim, ...] (weight or bias), numpy.
    """
    import numpy as np

    a = np.asarray(w)
    return a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
