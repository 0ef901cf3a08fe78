"""The small causal router shared by every routed-embedding variant.

Seed vectors ``u`` [B, T, d] → ``W_proj`` (d → d_r) + learned router positions → N pre-LN causal attention blocks →
router states ``h`` [B, T, d_r]. On top of the trunk:

- ``l_self = Linear(h_i)`` [K] and ``l_cross``: M learnable queries attend over the router states of the *prefix*
  ``h_{≤i}`` (the paper does not say; attending over the whole sequence would leak future tokens), their M outputs
  concatenated and mapped to K logits;
- the blend ``l = α_i l_self + (1 - α_i) l_cross`` with ``α_i = sigmoid(w_α · h_i)``;
- ``w = softmax(l / τ_i)`` with a learned per-position temperature ``τ_i = exp(log_τ[i])`` (a function of the
  position only, so causal), optionally restricted to the top-k logits.

Every attention takes one additive mask [B, 1, T, P+T] (0 where allowed, a large negative number elsewhere), the
same the body uses, so the export graph needs a single mask input. The KV cache holds, per trunk layer, keys and
values [B, heads, P, hd], and the cross-attention keys and values [B, P, d_r]: decoding one token runs the trunk on
that token only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NEG = -1e9  # finite, so a fully masked row stays finite in every runtime


@dataclass(frozen=True)
class RouterConfig:
    """Shape of the router. ``n_experts`` is 0 for variants without experts (generative, dense+depth)."""

    in_dim: int
    width: int = 64
    layers: int = 2
    heads: int = 8
    ff_mult: int = 2
    n_queries: int = 8
    n_experts: int = 8
    top_k: int = 8
    max_positions: int = 512


def causal_mask(t: int, past: int, batch: int = 1) -> torch.Tensor:
    """[B, 1, T, P+T] additive mask: new position i sees the past and new positions ≤ i."""
    full = torch.triu(torch.full((t, past + t), NEG), diagonal=past + 1)
    return full[None, None].expand(batch, 1, t, past + t).contiguous()


class Block(nn.Module):
    """Pre-LN causal self-attention + GELU MLP, attention written out so every graph converter can trace it."""

    def __init__(self, width: int, heads: int, ff_mult: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"router width {width} is not divisible by heads {heads}")
        self.heads, self.hd = heads, width // heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, ff_mult * width)
        self.down = nn.Linear(ff_mult * width, width)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, W], mask [B, 1, T, P+T], past [B, H, P, hd] → (x, k, v) with k/v [B, H, P+T, hd]."""
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, self.hd).transpose(1, 2) for z in (q, k, v))
        if past_k is not None and past_v is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        att = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(self.hd) + mask, dim=-1)  # [B, H, T, P+T]
        y = (att @ v).transpose(1, 2).reshape(b, t, w)
        x = x + self.out(y)
        return x + self.down(F.gelu(self.up(self.ln2(x)))), k, v


class CausalRouter(nn.Module):
    """Trunk, cross-attending queries and (when ``n_experts > 0``) the blended, tempered routing weights."""

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.proj = nn.Linear(cfg.in_dim, w)
        self.pos = nn.Embedding(cfg.max_positions, w)
        self.blocks = nn.ModuleList(Block(w, cfg.heads, cfg.ff_mult) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(w)
        self.cross = cfg.n_queries > 0  # the depth-matched dense baseline has a plain trunk only
        if self.cross:
            self.queries = nn.Parameter(torch.randn(cfg.n_queries, w) * 0.02)
            self.ck = nn.Linear(w, w)
            self.cv = nn.Linear(w, w)
        self.context_dim = w + cfg.n_queries * w  # [h_i ; c_i] what a generator head reads
        if cfg.n_experts:
            if not self.cross:
                raise ValueError("a router with experts needs n_queries >= 1 (the cross logits)")
            if not 1 <= cfg.top_k <= cfg.n_experts:
                raise ValueError(f"top_k {cfg.top_k} must be between 1 and n_experts {cfg.n_experts}")
            self.self_logits = nn.Linear(w, cfg.n_experts)
            self.cross_logits = nn.Linear(cfg.n_queries * w, cfg.n_experts)
            self.alpha = nn.Linear(w, 1)
            self.log_tau = nn.Parameter(torch.zeros(cfg.max_positions))

    @property
    def n_cache(self) -> int:
        """Cache tensors: k and v per trunk layer, then cross k and v."""
        return 2 * self.cfg.layers + (2 if self.cross else 0)

    def forward(
        self, u: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, past: tuple[torch.Tensor, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Router states and query context.

        Args:
            u: seed vectors [B, T, in_dim].
            position_ids: absolute positions [B, T] (< max_positions).
            mask: [B, 1, T, P+T] additive causal mask.
            past: ``n_cache`` tensors from a previous call, or empty.

        Returns:
            h [B, T, W], c [B, T, M·W] (the M queries' prefix summaries), present cache (``n_cache`` tensors).
        """
        x = self.proj(u) + self.pos(position_ids)
        present: list[torch.Tensor] = []
        for i, blk in enumerate(self.blocks):
            x, k, v = blk(x, mask, past[2 * i] if past else None, past[2 * i + 1] if past else None)
            present += [k, v]
        h = self.ln_f(x)
        if not self.cross:
            return h, h[..., :0], tuple(present)
        ck, cv = self.ck(h), self.cv(h)  # [B, T, W]
        if past:
            ck, cv = torch.cat([past[-2], ck], dim=1), torch.cat([past[-1], cv], dim=1)
        # every query scores every key once ([B, M, S]); position i then softmaxes over its own prefix
        s = (self.queries @ ck.transpose(1, 2)) / math.sqrt(self.cfg.width)  # [B, M, S]
        att = torch.softmax(s[:, None, :, :] + mask.transpose(1, 2), dim=-1)  # [B, T, M, S]; mask [B, T, 1, S]
        c = (att @ cv[:, None]).flatten(2)  # [B, T, M·W]
        return h, c, (*present, ck, cv)

    def route(
        self,
        h: torch.Tensor,
        c: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blended logits ``l`` [B, T, K] (before the temperature) and routing weights ``w`` [B, T, K] summing to 1."""
        alpha = torch.sigmoid(self.alpha(h))  # [B, T, 1]
        logits = alpha * self.self_logits(h) + (1 - alpha) * self.cross_logits(c)
        z = logits / torch.exp(self.log_tau[position_ids])[..., None]
        if self.cfg.top_k < self.cfg.n_experts:
            top, idx = torch.topk(z, self.cfg.top_k, dim=-1)
            w = torch.zeros_like(z).scatter(-1, idx, torch.softmax(top, dim=-1))
        else:
            w = torch.softmax(z, dim=-1)
        return logits, w


def router_param_count(cfg: RouterConfig) -> int:
    """Closed form of ``CausalRouter(cfg)``'s parameter count."""
    w, m, k = cfg.width, cfg.n_queries, cfg.n_experts
    block = (
        2 * 2 * w
        + (w * 3 * w + 3 * w)
        + (w * w + w)
        + (w * cfg.ff_mult * w + cfg.ff_mult * w)
        + (cfg.ff_mult * w * w + w)
    )
    n = (cfg.in_dim * w + w) + cfg.max_positions * w + cfg.layers * block + 2 * w
    if m:
        n += m * w + 2 * (w * w + w)
    if k:
        n += (w * k + k) + (m * w * k + k) + (w + 1) + cfg.max_positions
    return n


def diversity_loss(e: torch.Tensor) -> torch.Tensor:
    """Mean squared cosine similarity between different experts' outputs. e: [B, T, K, d] → scalar (0: orthogonal).

    The paper names a diversity loss without a formula; this one pushes experts apart per token."""
    n = F.normalize(e.float(), dim=-1)
    g = n @ n.transpose(-1, -2)  # [B, T, K, K]
    k = e.shape[-2]
    off = g.pow(2).sum((-1, -2)) - g.diagonal(dim1=-2, dim2=-1).pow(2).sum(-1)
    return (off / max(1, k * (k - 1))).mean()
