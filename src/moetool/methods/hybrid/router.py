"""The hybrid router: a tiny MLP over request features → softmax scores over the experts.

Features (``HybridRouterSpec.features``, in this order when present):

- ``length``: ``min(L, max_length) / max_length`` for a request of ``L`` tokens (per token: ``(t + 1) / max_length``);
- ``domain``: one-hot over the recipe's domains, all zero when the domain is unknown (id -1);
- ``hidden``: the cheap encoder's hidden states mean-pooled over the request (per token: the causal running mean).

Inputs are standardised with a mean/std measured on the training requests (stored as buffers, so an exported router
needs nothing else). Training mixes the experts softly with the scores; inference takes the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FeatureLayout:
    """Which features a router reads and their widths; ``width`` is the MLP's input size."""

    length: bool
    n_domains: int  # 0: no domain feature
    hidden_dim: int  # 0: no hidden feature
    max_length: int

    @property
    def width(self) -> int:
        return int(self.length) + self.n_domains + self.hidden_dim


def router_param_count(in_features: int, hidden: int, n_experts: int = 2, utility_head: bool = False) -> int:
    """Closed form: ``in·H + H + H·K + K`` (+ ``H + 1`` for the utility head); ``in·K + K`` when ``H = 0``.

    The paper's [l, d] → 16 → 2 router has ``2·16 + 16 + 16·2 + 2 = 82`` parameters (not the ~1.3K it states).
    """
    if hidden == 0:
        return in_features * n_experts + n_experts
    return in_features * hidden + hidden + hidden * n_experts + n_experts + (hidden + 1 if utility_head else 0)


class HybridRouter(nn.Module):
    """``x [..., F]`` → logits ``[..., K]`` (and the predicted utility ``[...]`` with a utility head)."""

    input_mean: torch.Tensor
    input_std: torch.Tensor
    utility: nn.Linear | None

    def __init__(self, in_features: int, hidden: int = 16, n_experts: int = 2, utility_head: bool = False) -> None:
        super().__init__()
        if in_features < 1:
            raise ValueError("the router needs at least one input feature")
        self.in_features, self.hidden, self.n_experts = in_features, hidden, n_experts
        self.register_buffer("input_mean", torch.zeros(in_features))
        self.register_buffer("input_std", torch.ones(in_features))
        self.body: nn.Module = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU()) if hidden else nn.Identity()
        self.gate = nn.Linear(hidden or in_features, n_experts)
        self.utility = nn.Linear(hidden, 1) if utility_head else None

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def set_normalisation(self, x: torch.Tensor) -> None:
        """Standardise inputs with the mean/std of ``x`` ``[N, F]`` (constant columns keep std 1)."""
        flat = x.reshape(-1, x.shape[-1]).float()
        std = flat.std(dim=0, unbiased=False)
        self.input_mean.copy_(flat.mean(dim=0))
        self.input_std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.body((x - self.input_mean) / self.input_std)
        logits = self.gate(h)
        util = self.utility(h).squeeze(-1) if self.utility is not None else None
        return logits, util

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax scores ``[..., K]`` (used to mix expert outputs while training)."""
        return torch.softmax(self.forward(x)[0], dim=-1)

    def choose(
        self, x: torch.Tensor, *, costly: int | None = None, utility_threshold: float | None = None
    ) -> torch.Tensor:
        """Hard choice ``[...]`` (int64): argmax of the scores, or with ``utility_threshold`` set, ``costly`` where
        the predicted gain exceeds it and the other expert elsewhere (two experts)."""
        logits, util = self.forward(x)
        if utility_threshold is None:
            return logits.argmax(dim=-1)
        if util is None or costly is None or self.n_experts != 2:
            raise ValueError("the utility rule needs a utility head, two experts and the costly expert's index")
        return torch.where(util > utility_threshold, costly, 1 - costly).long()


def length_feature(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """``[N]`` lengths → ``[N, 1]`` in (0, 1]: ``min(L, max_length) / max_length``."""
    return (lengths.float().clamp(max=max_length) / max_length).unsqueeze(-1)


def domain_feature(domains: torch.Tensor, n_domains: int) -> torch.Tensor:
    """``[N]`` domain ids (-1: unknown) → ``[N, n_domains]`` one-hot (an unknown domain is all zero)."""
    out = torch.zeros(domains.shape[0], n_domains)
    known = domains >= 0
    out[known, domains[known]] = 1.0
    return out


def sequence_features(
    layout: FeatureLayout, lengths: torch.Tensor, domains: torch.Tensor, pooled: torch.Tensor | None
) -> torch.Tensor:
    """Per-request features ``[N, F]`` from lengths ``[N]``, domain ids ``[N]`` and pooled hidden ``[N, H]``."""
    parts = []
    if layout.length:
        parts.append(length_feature(lengths, layout.max_length))
    if layout.n_domains:
        parts.append(domain_feature(domains, layout.n_domains))
    if layout.hidden_dim:
        if pooled is None or pooled.shape[-1] != layout.hidden_dim:
            raise ValueError(f"the router reads a pooled hidden state of width {layout.hidden_dim}")
        parts.append(pooled.float())
    return torch.cat(parts, dim=-1)


def token_features(
    layout: FeatureLayout, hidden: torch.Tensor | None, mask: torch.Tensor, domains: torch.Tensor
) -> torch.Tensor:
    """Per-token features ``[N, T, F]``: position ``(t+1)/max_length``, domain, causal running mean of ``hidden``
    ``[N, T, H]`` (token t sees tokens 0..t only, as it would while streaming). ``mask`` ``[N, T]`` marks real tokens.
    """
    n, t = mask.shape
    parts = []
    if layout.length:
        pos = torch.arange(1, t + 1, dtype=torch.float32).expand(n, t)
        parts.append((pos.clamp(max=layout.max_length) / layout.max_length).unsqueeze(-1))
    if layout.n_domains:
        parts.append(domain_feature(domains, layout.n_domains).unsqueeze(1).expand(n, t, layout.n_domains))
    if layout.hidden_dim:
        if hidden is None:
            raise ValueError("the router reads hidden states")
        m = mask.float().unsqueeze(-1)
        running = (hidden.float() * m).cumsum(dim=1) / m.cumsum(dim=1).clamp(min=1.0)
        parts.append(running)
    return torch.cat(parts, dim=-1)
