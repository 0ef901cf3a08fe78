"""A Core ML–shaped wrapper of ExportLM: the KV cache lives in two buffers that Core ML turns into iOS 18 states.

``forward(input_ids [1, T], position_ids [1, T], mask [1, 1, T, E]) -> logits [1, T, V]`` where ``E`` is the
number of positions after this call (past + T). The new keys/values are written to cache slots ``E-T … E-1`` and
attention reads slots ``0 … E-1``; prefill and decode are the same function with different T.
Buffers: ``k_cache``/``v_cache`` [layers, 1, kv_heads, capacity, head_dim].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetool.export.graph.model import ExportLM


def _rotate(x: torch.Tensor, half: int) -> torch.Tensor:
    """rotate_half with a Python-int split: a traced ``shape // 2`` becomes an op Core ML cannot fold."""
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
        inv_freq: torch.Tensor = m.inv_freq  # type: ignore[assignment]
        freqs = position_ids.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        blocks: list[Any] = list(m.layers)
        for i, block in enumerate(blocks):
            a = block.attn
            h = block.attn_norm(x)
            q = a.q(h).view(1, t, a.n_head, a.head_dim)
            k = a.k(h).view(1, t, a.n_kv, a.head_dim)
            v = a.v(h).view(1, t, a.n_kv, a.head_dim).transpose(1, 2)
            if a.q_norm is not None and a.k_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            half = a.head_dim // 2
            q = q * cos + _rotate(q, half) * sin
            k = k * cos + _rotate(k, half) * sin
            self.k_cache[i, :, :, begin:end] = k
            self.v_cache[i, :, :, begin:end] = v
            kk = self.k_cache[i, :, :, :end]
            vv = self.v_cache[i, :, :, :end]
            rep = a.n_head // a.n_kv
            qg = q.contiguous().view(1, a.n_kv, rep * t, a.head_dim)
            mask_g = mask.repeat(1, 1, rep, 1) if rep > 1 else mask
            scores = torch.matmul(qg, kk.transpose(2, 3)) * (a.head_dim**-0.5) + mask_g
            y = torch.matmul(torch.softmax(scores, dim=-1), vv).contiguous().view(1, a.n_head, t, a.head_dim)
            x = x + a.o(y.transpose(1, 2).reshape(1, t, a.n_head * a.head_dim))
            x = x + block.mlp(block.ffn_norm(x))
        logits: torch.Tensor = m.lm_head(m.norm(x))
        return logits
