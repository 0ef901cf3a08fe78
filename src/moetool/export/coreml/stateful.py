"""A Core ML–shaped wrapper of ExportLM: the KV cache lives in two buffers that Core ML turns into iOS 18 states.

``forward(input_ids [1, T], position_ids [1, T], mask [1, 1, T, E]) -> logits [1, T, V]`` where ``E`` is the
number of positions after this call (past + T). The new keys/values are written to cache slots ``E-T … E-1`` and
attention reads slots ``0 … E-1``; prefill and decode are the same function with different T.
Buffers: ``k_cache``/``v_cache`` [layers, 1, kv_heads, capacity, head_dim].
"""

from __future__ import annotations

import torch
from torch import nn

from moetool.export.graph.model import ExportLM, attend, qkv_rope


class StatefulLM(nn.Module):
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, model: ExportLM, capacity: int) -> None:
        super().__init__()
        self.model = model
        self.capacity = capacity
        shape = (model.n_layers, 1, model.n_kv, capacity, model.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = self.model
        t = input_ids.shape[1]
        end = mask.shape[-1]
        begin = end - t
        x = m.embed(input_ids)
        cos, sin = m.rope(position_ids)
        blocks = m.blocks()
        for i, block in enumerate(blocks):
            a = block.attn
            q, k, v = qkv_rope(a, block.attn_norm(x), cos, sin, bt=(1, t))
            self.k_cache[i, :, :, begin:end] = k
            self.v_cache[i, :, :, begin:end] = v
            x = x + attend(a, q, self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end], mask, bt=(1, t))
            x = x + block.mlp(block.ffn_norm(x))
        logits: torch.Tensor = m.lm_head(m.norm(x))
        return logits
