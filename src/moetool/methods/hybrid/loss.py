"""The hybrid router's loss: task CE of the soft mixture, balance, costly-expert hinge, expected latency, utility.

``L = CE + λ1·Bal + λ2·mean_u max(0, S_u,costly − T_u) + w_c·mean_u Σ_k S_u,k·c_k(L_u) + w_u·MSE(û, u)``

Where the paper is wrong and what this does instead (see docs/hybrid.md):

- Its Eq. 16, ``Σ S·log((1/|E|)/S)``, is ``−KL(S‖U)``: minimising it drives scores *away* from uniform. Here the
  balance term is ``KL(S‖U) = Σ_k S_k·log(S_k·K) ≥ 0``, zero at uniform scores.
- Its sums over tokens make the λ's depend on batch size and sequence length; every term here is a mean over
  routing units (requests, or tokens with per-token routing), so λ1 = 1, λ2 = 0.5, T_u = 0.08 mean the same at any
  batch size.
- The hinge caps the soft score of the costly expert, not the share of requests it receives; the cost term
  ``Σ_k S_k·c_k(L)`` prices each request by its measured latency instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS = 1e-9


def mixture_nll(expert_logp: torch.Tensor, mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Mean NLL per real token of the soft mixture ``Σ_k S_k·p_k(y_t)`` (nats).

    Args:
        expert_logp: ``[N, K, T]`` log-probability each (frozen) expert gave the target token at t.
        mask: ``[N, T]`` 1 for real tokens.
        scores: ``[N, K]`` (one score per request) or ``[N, T, K]`` (per token).
    """
    log_s = torch.log(scores.clamp_min(EPS))
    log_s = log_s.unsqueeze(-1) if log_s.dim() == 2 else log_s.transpose(1, 2)  # [N, K, 1] or [N, K, T]
    mixed = torch.logsumexp(expert_logp + log_s, dim=1)  # [N, T]
    m = mask.float()
    return -(mixed * m).sum() / m.sum().clamp_min(1.0)


def kl_uniform(scores: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over routing units of ``KL(S‖U) = Σ_k S_k·log(S_k·K)`` (≥ 0, 0 at uniform). scores ``[..., K]``."""
    k = scores.shape[-1]
    kl = (scores * torch.log(scores.clamp_min(EPS) * k)).sum(-1)
    return _mean(kl, weights)


def switch_balance(scores: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-level Switch-style balance ``K·Σ_k f_k·P_k`` (1 when balanced): f_k share of argmax, P_k mean score."""
    k = scores.shape[-1]
    flat = scores.reshape(-1, k)
    w = torch.ones(flat.shape[0]) if weights is None else weights.reshape(-1).float()
    w = w / w.sum().clamp_min(EPS)
    f = (torch.nn.functional.one_hot(flat.argmax(-1), k).float() * w[:, None]).sum(0)
    p = (flat * w[:, None]).sum(0)
    return k * (f * p).sum()


def costly_hinge(
    scores: torch.Tensor, costly: int, threshold: float, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over routing units of ``max(0, S_costly − T_u)``."""
    return _mean(torch.relu(scores[..., costly] - threshold), weights)


def expected_cost(scores: torch.Tensor, cost: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over routing units of ``Σ_k S_k·c_k`` with ``cost`` broadcastable to scores (e.g. ms per request)."""
    return _mean((scores * cost).sum(-1), weights)


def _mean(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return x.mean()
    w = weights.float()
    return (x * w).sum() / w.sum().clamp_min(EPS)


@dataclass
class LossTerms:
    """Every term of one evaluation of the loss (``total`` carries the gradient)."""

    total: torch.Tensor
    ce: float
    balance: float
    penalty: float
    cost: float
    utility: float


def hybrid_loss(
    *,
    expert_logp: torch.Tensor,
    mask: torch.Tensor,
    scores: torch.Tensor,
    costly: int,
    lambda_balance: float = 1.0,
    balance: str = "kl",
    lambda_penalty: float = 0.5,
    threshold: float = 0.08,
    cost: torch.Tensor | None = None,
    cost_weight: float = 0.0,
    utility_pred: torch.Tensor | None = None,
    utility_target: torch.Tensor | None = None,
    utility_weight: float = 1.0,
) -> LossTerms:
    """The router loss for scores ``[N, K]`` (per request) or ``[N, T, K]`` (per token, padded tokens ignored).

    ``cost`` ``[N, K]``: each expert's latency c_k(L) for each request (ms). ``utility_pred``/``utility_target``
    ``[N]`` (or ``[N, T]``): predicted and oracle quality gain of the costly expert, nats per token.
    """
    per_token = scores.dim() == 3
    weights = mask.float() if per_token else None
    ce = mixture_nll(expert_logp, mask, scores)
    if balance == "kl":
        bal = kl_uniform(scores, weights)
    elif balance == "switch":
        bal = switch_balance(scores, weights)
    elif balance == "none":
        bal = torch.zeros(())
    else:
        raise ValueError(f"balance must be kl, switch or none, got {balance!r}")
    pen = costly_hinge(scores, costly, threshold, weights)
    total = ce + lambda_balance * bal + lambda_penalty * pen
    cost_term = torch.zeros(())
    if cost is not None and cost_weight:
        c = cost.unsqueeze(1) if per_token else cost
        cost_term = expected_cost(scores, c, weights)
        total = total + cost_weight * cost_term
    util = torch.zeros(())
    if utility_pred is not None and utility_target is not None:
        util = _mean((utility_pred - utility_target) ** 2, weights)
        total = total + utility_weight * util
    ce_v, bal_v = float(ce.detach()), float(bal.detach())
    if not (math.isfinite(ce_v) and math.isfinite(bal_v)):
        raise FloatingPointError(f"router loss is not finite (ce {ce_v}, balance {bal_v})")
    return LossTerms(total, ce_v, bal_v, float(pen.detach()), float(cost_term.detach()), float(util.detach()))
