"""The model in the shape ExecuTorch's own LLM runner reads (``executorch.extension.llm.runner.TextLLMRunner``, the
C++ runner of its iOS and Android demo apps): one method ``forward(tokens, input_pos) -> logits`` with the KV cache
inside the program, and the metadata methods the runner asks for.

- ``tokens`` [1, T] int64, T from 1 to ``max_seq_len`` (the longest prefill; the runner splits a longer prompt and
  decodes with T = 1); ``input_pos`` [1] int64, the position of ``tokens[0, 0]`` (a static ``[1]`` is how the runner
  knows to pass the start position only).
- ``logits`` [1, T, V] float32: every position's, so the check can score a prefill; the runner samples the last row.
- The cache: ``k_cache_<i>``/``v_cache_<i>`` [1, kv_heads, context, head_dim] per layer, mutable buffers written in
  place at positions ``input_pos … input_pos+T-1``; attention reads the whole cache under a mask of the positions at
  or before each query's, so what a longer earlier sequence left beyond them is never read, and a new prompt at
  position 0 needs no reset (the runner resets by starting at 0).

Parameters keep the ExportLM's names (``layers.5.attn.q.weight``), so the plan's precisions apply by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moetool.export.graph.model import NEG, Attention, Block, qkv_rope

if TYPE_CHECKING:
    from moetool.export.graph.model import ExportLM

__all__ = ["RunnerLM", "runner_metadata"]


class RunnerLM(nn.Module):
    """``forward(tokens [1, T], input_pos [1]) -> logits [1, T, V]`` over ``em``'s embedding, head and rope and the
    decoder ``blocks`` (added as they are read: :meth:`add`), with a KV cache of ``context`` positions."""

    def __init__(self, em: ExportLM, context: int) -> None:
        super().__init__()
        self.embed, self.norm, self.lm_head, self.rope = em.embed, em.norm, em.lm_head, em.rope
        self.layers = nn.ModuleDict()
        self.context, self.n_kv, self.head_dim = context, em.n_kv, em.head_dim

    def add(self, index: int, block: Block) -> None:
        """Decoder layer ``index`` and its cache (zeros; not part of the state dict)."""
        self.layers[str(index)] = block
        shape = (1, self.n_kv, self.context, self.head_dim)
        self.register_buffer(f"k_cache_{index}", torch.zeros(shape), persistent=False)
        self.register_buffer(f"v_cache_{index}", torch.zeros(shape), persistent=False)

    def reset(self) -> None:
        """An empty cache (what an exported program starts from)."""
        for name, buf in self.named_buffers():
            if "_cache_" in name:
                buf.zero_()

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = input_pos[:1] + torch.arange(t)  # [T]: this call's positions
        cos, sin = self.rope(pos[None])
        # query i sees cache slots ≤ its position: [1, 1, T, context]
        mask = torch.where(torch.arange(self.context)[None, :] <= pos[:, None], 0.0, NEG)[None, None]
        x = self.embed(tokens)
        for i, block in self.layers.items():
            assert isinstance(block, Block)
            k_cache: torch.Tensor = getattr(self, f"k_cache_{i}")
            v_cache: torch.Tensor = getattr(self, f"v_cache_{i}")
            a = block.attn
            q, k, v = qkv_rope(a, block.attn_norm(x), cos, sin, bt=(1, t))
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            x = x + _attend_cache(a, q, k_cache, v_cache, mask, t)
            x = x + block.mlp(block.ffn_norm(x))
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits


def _attend_cache(
    a: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, t: int
) -> torch.Tensor:
    """q [1, H, T, hd] over the whole cache k/v [1, kv, C, hd] under ``mask`` [1, 1, T, C] → the output projection's
    result [1, T, D]. GQA by a group axis (q as [1, kv, H/kv, T, hd] against k/v broadcast over it): no copy of the
    cache, and no reshape that merges the dynamic T with a fixed size, which torch.export guards against T = 1."""
    rep = a.n_head // a.n_kv
    qg = q.reshape(1, a.n_kv, rep, t, a.head_dim)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(3, 4)) * (a.head_dim**-0.5) + mask.unsqueeze(2)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    y = torch.matmul(probs, v.unsqueeze(2)).reshape(1, a.n_head, t, a.head_dim)
    out: torch.Tensor = a.o(y.transpose(1, 2).reshape(1, t, a.n_head * a.head_dim))
    return out


def runner_metadata(*, max_seq_len: int, context: int, vocab: int, bos: int | None, eos: list[int], layers: int):
    """The constant methods the runner reads (``get_max_seq_len`` is required; ``get_eos_ids`` replaces the
    tokenizer's end tokens), and the informational ones ExecuTorch's own Llama export writes beside them."""
    meta: dict[str, int | bool | list[int]] = {
        "get_max_seq_len": max_seq_len,
        "get_max_context_len": context,
        "use_kv_cache": True,
        "enable_dynamic_shape": True,
        "use_sdpa_with_kv_cache": False,
        "get_vocab_size": vocab,
        "get_n_layers": layers,
    }
    if bos is not None:
        meta["get_bos_id"] = bos
    if eos:
        meta["get_eos_ids"] = eos
    return meta
