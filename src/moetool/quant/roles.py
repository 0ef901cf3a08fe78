"""Tensor roles, read from Hugging Face tensor names (the names every exporter starts from)."""

from __future__ import annotations

import re
from typing import Literal

Role = Literal["embeddings", "output", "norms", "attention", "router", "experts", "shared_expert", "ffn"]
ROLES: tuple[Role, ...] = ("embeddings", "output", "norms", "attention", "router", "experts", "shared_expert", "ffn")

# first match wins; patterns are searched in the full HF name
_RULES: tuple[tuple[str, Role], ...] = (
    (r"(^|\.)embed_tokens\.", "embeddings"),
    (r"(^|\.)lm_head\.", "output"),
    (r"norm(\.|$)", "norms"),
    (r"\.shared_expert_gate\.", "router"),
    (r"\.block_sparse_moe\.gate\.|\.mlp\.gate\.weight$|\.router\.", "router"),
    (r"\.shared_expert\.", "shared_expert"),
    (r"\.experts\.", "experts"),
    (r"\.block_sparse_moe\.(input|output)_linear\.", "experts"),  # GraniteMoE's stacked experts
    (r"\.self_attn\.", "attention"),
    (r"\.mlp\.(gate|up|down)_proj\.", "ffn"),
)
_COMPILED = [(re.compile(p), r) for p, r in _RULES]


def role_of(hf_name: str) -> Role:
    """The role of a tensor by its Hugging Face name.

    >>> role_of("model.layers.3.block_sparse_moe.experts.2.w1.weight")
    'experts'

    Raises:
        ValueError: for a name no rule knows (a new architecture must add its names here).
    """
    for pat, role in _COMPILED:
        if pat.search(hf_name):
            return role
    raise ValueError(f"cannot tell the role of tensor {hf_name!r}")
