"""ExportLM with a fixed-capacity KV cache passed in and out, and only static shapes (TFLite needs them).

``forward(input_ids [1, T], position_ids [1, T], mask [1, 1, T, C], k_0, v_0, …) -> (logits, k_0', v_0', …)`` (or,
for a chunk of the layers, hidden states in or out) with
caches [1, kv_heads, C, head_dim]. The new keys/values are written at ``position_ids`` through a one-hot [T, C]
matrix (a blend, not a scatter), and attention reads all C slots with ``mask`` hiding the unwritten ones. Prefill is
T = the prefill length (shorter prompts are right-padded: causal attention keeps real positions unaffected, and the
padded slots are overwritten by later decode steps); decode is T = 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moetool.export.graph.model import NEG, Block, ExportLM, attend, qkv_rope

if TYPE_CHECKING:
    from moetool.export.graph.chunk import ExportChunk


class StaticCacheLM(nn.Module):
    """``model`` (the whole ExportLM, or an :class:`~moetool.export.graph.chunk.ExportChunk` of some layers: its first
    input is then token ids or the previous chunk's hidden states ``[1, T, D]``, its first output logits or hidden
    states) with a cache of ``capacity`` slots per layer."""

    def __init__(self, model: ExportLM | ExportChunk, capacity: int) -> None:
        super().__init__()
        self.model = model
        self.capacity = capacity

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, *caches: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        m = self.model
        onehot = (position_ids[0][:, None] == torch.arange(self.capacity)[None]).float()  # [T, C]
        keep = 1.0 - onehot.sum(0)[None, None, :, None]  # [1, 1, C, 1]
        write = onehot.t()[None, None]  # [1, 1, C, T]
        if m.embed is not None:
            x = m.embed(x)
        cos, sin = m.rope(position_ids)
        out: list[torch.Tensor] = []
        layers = m.layers.values() if isinstance(m.layers, nn.ModuleDict) else m.layers
        blocks = [b for b in layers if isinstance(b, Block)]
        for i, block in enumerate(blocks):
            a = block.attn
            q, k, v = qkv_rope(a, block.attn_norm(x), cos, sin)
            kc = caches[2 * i] * keep + torch.matmul(write, k)  # [1, kv, C, hd]
            vc = caches[2 * i + 1] * keep + torch.matmul(write, v)
            out += [kc, vc]
            x = x + attend(a, q, kc, vc, mask)
            x = x + block.mlp(block.ffn_norm(x))
        if m.lm_head is not None and m.norm is not None:
            x = m.lm_head(m.norm(x))
        return (x, *out)

    def empty_cache(self) -> list[torch.Tensor]:
        shape = (1, self.model.n_kv, self.capacity, self.model.head_dim)
        return [torch.zeros(shape) for _ in range(2 * self.model.n_layers)]


def static_mask(position_ids: torch.Tensor, capacity: int, valid: int | None = None) -> torch.Tensor:
    """[1, 1, T, C]: token at position p sees slots 0…p (and, with ``valid``, nothing at or beyond ``valid``)."""
    pos = position_ids[0][:, None]
    slots = torch.arange(capacity)[None]
    seen = slots <= pos
    if valid is not None:
        seen = seen & (slots < valid)
    return torch.where(seen, 0.0, NEG)[None, None].float()
