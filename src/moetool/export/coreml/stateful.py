"""A Core ML–shaped wrapper of some decoder layers of an ExportLM: their KV cache lives in two buffers that Core ML
turns into iOS 18 states. A model is one such chunk (all its layers) or several run in sequence.

``forward(x, position_ids [1, T], mask [1, 1, T, E]) -> y`` where ``E`` is the number of positions after this call
(past + T). ``x`` is ``input_ids [1, T]`` for the first chunk (it embeds them), the previous chunk's hidden states
``[1, T, D]`` otherwise; ``y`` is ``logits [1, T, V]`` for the last chunk (final norm and head), hidden states
otherwise. The new keys/values are written to cache slots ``E-T … E-1`` and attention reads slots ``0 … E-1``;
prefill and decode are the same function with different T.
Buffers: ``k_cache``/``v_cache`` [chunk's layers, 1, kv_heads, capacity, head_dim].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from moetool.export.graph.chunk import ExportChunk
from moetool.export.graph.model import Block, ExportLM, attend, qkv_rope

__all__ = ["StatefulChunk"]


class StatefulChunk(nn.Module):
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(
        self, em: ExportLM, blocks: Mapping[int, Block], capacity: int, *, first: bool = True, last: bool = True
    ) -> None:
        super().__init__()
        # the chunk's modules under the ExportLM's own names (``model.layers.5.attn.q.weight``), so the plan's
        # precisions and the converted program's weight names read the same whichever chunk holds a layer
        self.model = ExportChunk(em, blocks, first=first, last=last)
        self.capacity = capacity
        self.first, self.last = first, last
        self.hidden_size = self.model.hidden_size
        shape = (len(blocks), 1, em.n_kv, capacity, em.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def reset(self) -> None:
        """An empty cache: what a new sequence starts from."""
        self.k_cache.zero_()
        self.v_cache.zero_()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = self.model
        t = position_ids.shape[1]
        end = mask.shape[-1]
        begin = end - t
        if m.embed is not None:
            x = m.embed(x)
        cos, sin = m.rope(position_ids)
        blocks: list[Block] = [b for b in m.layers.values() if isinstance(b, Block)]
        for i, block in enumerate(blocks):
            a = block.attn
            q, k, v = qkv_rope(a, block.attn_norm(x), cos, sin, bt=(1, t))
            self.k_cache[i, :, :, begin:end] = k
            self.v_cache[i, :, :, begin:end] = v
            x = x + attend(a, q, self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end], mask, bt=(1, t))
            x = x + block.mlp(block.ffn_norm(x))
        if m.lm_head is None or m.norm is None:
            return x
        logits: torch.Tensor = m.lm_head(m.norm(x))
        return logits
