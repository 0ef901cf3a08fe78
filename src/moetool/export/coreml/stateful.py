"""A Core ML–shaped wrapper of some decoder layers of an ExportLM: their KV cache lives in two buffers that Core ML
turns into iOS 18 states. A model is one such chunk (all its layers) or several, converted apart and joined into one
program (:mod:`moetool.export.coreml.join`).

``forward(x, causalMask [1, 1, T, E]) -> y`` where ``E`` is the number of positions after this call (past + T) and
the positions of the new tokens are ``E-T … E-1``: derived from the mask's shape, as Apple's stateful Llama does, so
there is no ``position_ids`` input. ``x`` is ``inputIds [1, T]`` for the first chunk (it embeds them), the previous
chunk's hidden states ``[1, T, D]`` otherwise; ``y`` is ``logits [1, T, V]`` for the last chunk (final norm and head),
hidden states otherwise. The new keys/values are written to cache slots ``E-T … E-1`` and attention reads slots
``0 … E-1``; prefill and decode are the same function with different T.

Buffers: ``keyCache``/``valueCache`` [all the model's layers, 1, kv_heads, capacity, head_dim], whichever layers the
chunk holds: every chunk declares the same two states, writing only its own layers' slots, so the joined program
takes each state once (the names and layout swift-transformers' ``LanguageModel`` looks for).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from moetool.export.graph.chunk import ExportChunk
from moetool.export.graph.model import Block, ExportLM, attend, qkv_rope

__all__ = ["STATES", "StatefulChunk"]

# the state names, in the order a converted program declares them
STATES = ("keyCache", "valueCache")


class StatefulChunk(nn.Module):
    # the buffers' names are the Core ML states' names
    keyCache: torch.Tensor
    valueCache: torch.Tensor

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
        self.layer_ids = [int(i) for i in blocks]  # each layer's slot in the model-wide cache
        shape = (em.n_layers, 1, em.n_kv, capacity, em.head_dim)
        self.register_buffer("keyCache", torch.zeros(shape))
        self.register_buffer("valueCache", torch.zeros(shape))

    def reset(self) -> None:
        """An empty cache: what a new sequence starts from."""
        self.keyCache.zero_()
        self.valueCache.zero_()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = self.model
        t = x.shape[1]
        end = mask.shape[-1]
        begin = end - t
        if m.embed is not None:
            x = m.embed(x)
        cos, sin = m.rope(torch.arange(begin, end)[None])
        blocks: list[Block] = [b for b in m.layers.values() if isinstance(b, Block)]
        for li, block in zip(self.layer_ids, blocks, strict=True):
            a = block.attn
            q, k, v = qkv_rope(a, block.attn_norm(x), cos, sin, bt=(1, t))
            self.keyCache[li, :, :, begin:end] = k
            self.valueCache[li, :, :, begin:end] = v
            x = x + attend(a, q, self.keyCache[li, :, :, :end], self.valueCache[li, :, :, :end], mask, bt=(1, t))
            x = x + block.mlp(block.ffn_norm(x))
        if m.lm_head is None or m.norm is None:
            return x
        logits: torch.Tensor = m.lm_head(m.norm(x))
        return logits
