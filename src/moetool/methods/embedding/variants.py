"""Routed input embeddings: one module family mapping ids [B, T] → hidden [B, T, D], strictly causal.

Every variant builds a seed-space vector ``z_i`` ∈ R^d and maps it to model width with an explicit projection
``W`` (d → D, no bias; the paper never says how its 64-d output meets a 512-d body):

- ``dense``: ``z = E[x]`` (a factorised table, no router) or, with ``depth > 0``, ``z = E[x] + G(R(E[x], x_≤i))``
  (the same causal trunk, no queries, no routing): the fair baselines.
- ``selection``: ``e_k = AvgPool(P[x] ⊙ sigmoid(MLP_k(P[x])))`` over a wide pool table P [V, pool_dim],
  ``z = Σ_k w_k e_k``.
- ``remix``: ``S_k = softmax_rows(MLP_k(u))`` [d, d] (row a says how much of input dim b output dim a takes; rows
  sum to 1), ``e_k = S_k u``, ``z = Σ_k w_k e_k`` with ``u = E[x]``.
- ``generative``: ``z = LayerNorm(u + Dropout(G([h_i ; c_i])))`` with G's weights zero at init.

``w`` are the router's weights (:mod:`.router`); the router and every expert read the token and its prefix only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from moetool.io.jsontypes import JsonObject
from moetool.io.narrow import scalar_fields
from moetool.methods.embedding.router import CausalRouter, RouterConfig, causal_mask, diversity_loss, router_param_count
from moetool.routing.losses import load_balancing_loss, router_z_loss

Variant = Literal["dense", "selection", "remix", "generative"]
VARIANTS: tuple[str, ...] = ("dense", "selection", "remix", "generative")


class EmbeddingArgs(TypedDict, total=False):
    """:class:`EmbeddingConfig`'s fields other than the table's shape (``vocab_size``, ``d_model``): a recipe's
    ``embedding`` section, or an arm of the report."""

    variant: str
    seed_dim: int
    pool_dim: int
    mask_hidden: int
    n_experts: int
    top_k: int
    depth: int
    router: dict[str, int]
    max_positions: int
    dropout: float
    ln_eps: float
    remix_diag: float
    aux: dict[str, float]


_MAPPING_FIELDS = ("router", "aux")  # checked entry by entry below; the others are str, int or float
_SCALAR_FIELDS = tuple(k for k in EmbeddingArgs.__annotations__ if k not in _MAPPING_FIELDS)


def embedding_args(kw: Mapping[str, object]) -> EmbeddingArgs:
    """``kw`` (a recipe's ``module_kwargs()``) checked field by field as :class:`EmbeddingArgs`.

    Raises:
        ValueError: a key that is not a field, or a value of the wrong type (naming them).
    """
    args = scalar_fields(EmbeddingArgs, kw, _SCALAR_FIELDS)
    if isinstance(r := kw.get("router"), Mapping):
        args["router"] = {str(k): int(v) for k, v in r.items() if isinstance(v, int)}
    if isinstance(a := kw.get("aux"), Mapping):
        args["aux"] = {str(k): float(v) for k, v in a.items() if isinstance(v, int | float)}
    wrong = sorted(set(kw) - set(args))
    if wrong:
        raise ValueError(f"embedding: {', '.join(wrong)}: not an embedding setting of the expected type")
    return args


@dataclass(frozen=True)
class EmbeddingConfig:
    """Everything that fixes the module's shapes (saved in the model's config.json)."""

    variant: str
    vocab_size: int
    d_model: int
    seed_dim: int = 32
    pool_dim: int = 256  # selection only
    mask_hidden: int = 64  # selection only: width of each expert's mask MLP
    n_experts: int = 8
    top_k: int = 8
    depth: int = 0  # dense only: router trunk layers on top of the table (0: none)
    router: dict[str, int] = field(default_factory=dict)  # width, layers, heads, ff_mult, n_queries
    max_positions: int = 512
    dropout: float = 0.0  # generative only
    ln_eps: float = 1e-5
    remix_diag: float = 8.0  # remix init: logit bias on the diagonal, so S_k starts near the identity
    aux: dict[str, float] = field(default_factory=lambda: {"balance": 0.01, "z": 0.001, "diversity": 0.01})

    def to_dict(self) -> JsonObject:
        fields: JsonObject = asdict(self)
        return fields

    def router_config(self) -> RouterConfig | None:
        r = dict(self.router)
        if self.variant == "dense":
            if not self.depth:
                return None
            r |= {"layers": self.depth, "n_queries": 0}
            experts, top_k = 0, 0
        elif self.variant == "generative":
            experts, top_k = 0, 0
        else:
            experts, top_k = self.n_experts, self.top_k
        in_dim = self.seed_dim
        return RouterConfig(in_dim=in_dim, n_experts=experts, top_k=top_k, max_positions=self.max_positions, **r)


class RoutedEmbedding(nn.Module):
    """``forward(input_ids, position_ids, mask, *past) -> (hidden [B, T, D], present, aux)``."""

    def __init__(self, cfg: EmbeddingConfig) -> None:
        super().__init__()
        if cfg.variant not in VARIANTS:
            raise ValueError(f"variant {cfg.variant!r}: expected one of {', '.join(VARIANTS)}")
        self.cfg = cfg
        d, v = cfg.seed_dim, cfg.vocab_size
        if cfg.variant == "selection":
            if cfg.pool_dim % d:
                raise ValueError(f"pool_dim {cfg.pool_dim} must be a multiple of seed_dim {d} (average pooling)")
            self.table = nn.Embedding(v, cfg.pool_dim)
            k, hm, p = cfg.n_experts, cfg.mask_hidden, cfg.pool_dim
            self.mask_up = nn.Linear(p, k * hm)
            self.mask_down = nn.Parameter(torch.zeros(k, hm, p))  # zero: every mask starts at sigmoid(0) = 0.5
            self.mask_bias = nn.Parameter(torch.zeros(k, p))
        else:
            self.table = nn.Embedding(v, d)
        if cfg.variant == "remix":
            self.mix = nn.Linear(d, cfg.n_experts * d * d)  # all K experts' [d, d] logits at once
        rc = cfg.router_config()
        self.router = CausalRouter(rc) if rc is not None else None
        if cfg.variant == "generative" or (cfg.variant == "dense" and self.router is not None):
            assert self.router is not None
            ctx = self.router.context_dim if cfg.variant == "generative" else self.router.cfg.width
            self.gen = nn.Linear(ctx, d)
            self.drop = nn.Dropout(cfg.dropout)
        if cfg.variant == "generative":
            self.norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.proj = nn.Linear(d, cfg.d_model, bias=False)
        self.compute_aux = True  # export graphs turn the training-only losses off
        self.reset_parameters()

    @property
    def n_cache(self) -> int:
        return self.router.n_cache if self.router is not None else 0

    def reset_parameters(self) -> None:
        """N(0, 0.02) everywhere (the paper's init), but the generator and mask outputs at zero and remix near I."""
        for name, p in self.named_parameters():
            if name.startswith("router.") and ("ln" in name or "log_tau" in name):
                continue
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if hasattr(self, "gen"):
            nn.init.zeros_(self.gen.weight)
            nn.init.zeros_(self.gen.bias)
        if hasattr(self, "mask_down"):
            nn.init.zeros_(self.mask_down)
            nn.init.zeros_(self.mask_bias)
        if hasattr(self, "mix"):
            d, k = self.cfg.seed_dim, self.cfg.n_experts
            with torch.no_grad():
                self.mix.bias.copy_((torch.eye(d) * self.cfg.remix_diag).repeat(k, 1, 1).flatten())

    def seed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The router's input [B, T, d]: the seed row (selection: the pooled pool row)."""
        e = self.table(input_ids)
        if self.cfg.variant == "selection":
            return self._pool(e)
        result: torch.Tensor = e
        return result

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        """Average pooling of the last axis in groups: [..., pool_dim] → [..., seed_dim]."""
        g = self.cfg.pool_dim // self.cfg.seed_dim
        return x.reshape(*x.shape[:-1], self.cfg.seed_dim, g).mean(-1)

    def remix_matrices(self, u: torch.Tensor) -> torch.Tensor:
        """S_k for every token: [B, T, K, d, d], each row a softmax over the input dims."""
        d, k = self.cfg.seed_dim, self.cfg.n_experts
        return torch.softmax(self.mix(u).reshape(*u.shape[:-1], k, d, d), dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, ...] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """ids [B, T] (new tokens), positions [B, T], mask [B, 1, T, P+T], past: ``n_cache`` tensors or empty.

        Returns hidden [B, T, D], the present cache and the auxiliary losses (``total`` is their weighted sum).
        """
        cfg = self.cfg
        e = self.table(input_ids)
        u = self._pool(e) if cfg.variant == "selection" else e  # [B, T, d]
        aux: dict[str, torch.Tensor] = {}
        present: tuple[torch.Tensor, ...] = ()
        if self.router is None:  # dense factorised table
            return self.proj(u), present, {"total": u.new_zeros(())}
        h, c, present = self.router(u, position_ids, mask, past)
        if cfg.variant == "dense":
            z = u + self.drop(self.gen(h))
        elif cfg.variant == "generative":
            z = self.norm(u + self.drop(self.gen(torch.cat([h, c], dim=-1))))
        else:
            logits, w = self.router.route(h, c, position_ids)
            if cfg.variant == "remix":
                experts = (self.remix_matrices(u) @ u[..., None, :, None]).squeeze(-1)  # [B, T, K, d]
            else:
                k, hm = cfg.n_experts, cfg.mask_hidden
                a = F.gelu(self.mask_up(e)).reshape(*e.shape[:-1], k, 1, hm)  # [B, T, K, 1, hm]
                m = torch.sigmoid((a @ self.mask_down).squeeze(-2) + self.mask_bias)  # [B, T, K, pool]
                experts = self._pool(e[..., None, :] * m)  # [B, T, K, d]
            z = (w[..., None] * experts).sum(-2)
            if not self.compute_aux:
                return self.proj(z), present, {}
            flat = logits.reshape(-1, logits.shape[-1])
            aux = {
                "balance": load_balancing_loss(flat, cfg.top_k),
                "z": router_z_loss(flat),
                "diversity": diversity_loss(experts),
            }
        total = sum((cfg.aux.get(k, 0.0) * v for k, v in aux.items()), u.new_zeros(()))
        return self.proj(z), present, aux | {"total": total}

    def routing_weights(self, input_ids: torch.Tensor) -> torch.Tensor:
        """w [B, T, K] for a whole sequence (selection, remix)."""
        if self.router is None or not self.router.cfg.n_experts:
            raise ValueError(f"the {self.cfg.variant} variant has no routing weights")
        b, t = input_ids.shape
        pos = torch.arange(t)[None].expand(b, t)
        h, c, _ = self.router(self.seed(input_ids), pos, causal_mask_like(input_ids))
        return self.router.route(h, c, pos)[1]


def causal_mask_like(input_ids: torch.Tensor) -> torch.Tensor:

    b, t = input_ids.shape
    return causal_mask(t, 0, b).to(input_ids.device)


def param_counts(cfg: EmbeddingConfig) -> dict[str, int]:
    """Closed-form parameter counts of ``RoutedEmbedding(cfg)`` by part (``total`` is their sum)."""
    d, v, k = cfg.seed_dim, cfg.vocab_size, cfg.n_experts
    out = {"table": v * (cfg.pool_dim if cfg.variant == "selection" else d), "experts": 0, "router": 0, "generator": 0}
    rc = cfg.router_config()
    if rc is not None:
        out["router"] = router_param_count(rc)
        ctx = rc.width + rc.n_queries * rc.width
        if cfg.variant in ("dense", "generative"):
            out["generator"] = (ctx if cfg.variant == "generative" else rc.width) * d + d
        if cfg.variant == "generative":
            out["generator"] += 2 * d  # LayerNorm
    if cfg.variant == "remix":
        out["experts"] = d * k * d * d + k * d * d
    if cfg.variant == "selection":
        p, hm = cfg.pool_dim, cfg.mask_hidden
        out["experts"] = p * k * hm + k * hm + k * hm * p + k * p
    out["projection"] = d * cfg.d_model
    out["total"] = sum(out.values())
    return out


def measured_counts(m: RoutedEmbedding) -> dict[str, int]:
    """The same parts counted from the module's parameters."""
    parts = {"table": 0, "experts": 0, "router": 0, "generator": 0, "projection": 0}
    for name, p in m.named_parameters():
        top = name.split(".")[0]
        key = {"table": "table", "router": "router", "proj": "projection", "gen": "generator", "norm": "generator"}.get(
            top, "experts"
        )
        parts[key] += p.numel()
    parts["total"] = sum(parts.values())
    return parts


def dense_dim_for_budget(budget: int, vocab: int, d_model: int) -> int:
    """The largest seed dim whose factorised dense table (V·d + d·D) fits in ``budget`` parameters."""
    return max(1, math.floor(budget / (vocab + d_model)))
