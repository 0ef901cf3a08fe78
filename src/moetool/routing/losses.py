"""Routing losses: Switch-style load balancing and router z-loss, per layer, averaged over layers.

Every function takes router logits of one layer, ``[T, E]`` (T tokens, E experts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def load_balancing_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer balance loss generalised to top-k: ``E · Σ_i f_i · P_i``.

    ``f_i`` is the share of the T·k routing assignments that go to expert i (so Σ f = 1) and ``P_i`` the mean router
    probability of expert i. It equals 1 when routing is uniform, whatever k is, and grows to E when one expert takes
    everything. (Mixtral's implementation sums over the k slots without dividing by k, so its balanced value is k.)

    Args:
        logits: ``[T, E]``.
        top_k: experts per token.

    Returns:
        A scalar.
    """
    n_exp = logits.shape[-1]
    probs = logits.float().softmax(dim=-1)  # [T, E]
    chosen = probs.topk(top_k, dim=-1).indices  # [T, k]
    counts = torch.zeros(n_exp, device=logits.device).index_add_(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), device=logits.device)
    )
    f = counts / chosen.numel()  # [E], no gradient: the argmax is not differentiable
    p = probs.mean(dim=0)  # [E]
    return n_exp * (f * p).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)²``; keeps router logits small and stable.

    Args:
        logits: ``[T, E]``.
    """
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def routing_losses(per_layer: Sequence[torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing, z-loss), each averaged over layers."""
    lb = torch.stack([load_balancing_loss(x, top_k) for x in per_layer]).mean()
    z = torch.stack([router_z_loss(x) for x in per_layer]).mean()
    return lb, z


def routing_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean per-token entropy (nats) of the router distribution. ``logits``: ``[T, E]``."""
    logp = logits.float().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(-1).mean()


def expert_load(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Share of top-k assignments per expert, ``[E]`` summing to 1."""
    chosen = logits.topk(top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(chosen, minlength=logits.shape[-1]).float() / chosen.numel()
