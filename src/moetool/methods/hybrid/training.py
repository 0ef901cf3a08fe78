"""Router-only training on cached expert outputs, hard-routed evaluation, and the oracle router."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moetool.methods.hybrid.data import ExpertOutputs, Requests, pooled_hidden
from moetool.methods.hybrid.loss import hybrid_loss, mixture_nll
from moetool.methods.hybrid.records import ChoiceFigures
from moetool.methods.hybrid.router import FeatureLayout, HybridRouter, sequence_features, token_features
from moetool.recipe.hybrid import HybridLossSpec


@dataclass
class RoutingSet:
    """One split, ready for the router: features ``[N, F]`` (per request) or ``[N, T-1, F]`` (per token), expert
    log-probs ``[N, K, T-1]``, target mask ``[N, T-1]``, lengths ``[N]``, cost ``[N, K]`` (ms, fitted profile)."""

    features: torch.Tensor
    logp: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    cost: torch.Tensor
    domains: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def per_token(self) -> bool:
        return self.features.dim() == 3

    def seq_nll(self) -> torch.Tensor:
        """``[N, K]`` each expert's mean NLL per token on each request."""
        return ExpertOutputs(self.logp, None).seq_nll(self.mask)

    def utility_target(self, costly: int) -> torch.Tensor:
        """The costly expert's gain in nats/token: ``[N]`` per request, ``[N, T-1]`` per token."""
        cheap = 1 - costly
        if self.per_token:
            return self.logp[:, costly] - self.logp[:, cheap]
        nll = self.seq_nll()
        return nll[:, cheap] - nll[:, costly]

    def subset(self, idx: torch.Tensor) -> RoutingSet:
        dom = self.domains[idx] if self.domains.numel() else self.domains
        return RoutingSet(self.features[idx], self.logp[idx], self.mask[idx], self.lengths[idx], self.cost[idx], dom)


def build_set(
    layout: FeatureLayout, granularity: str, req: Requests, outs: ExpertOutputs, cost: torch.Tensor
) -> RoutingSet:
    """Router features for ``req`` from the cached ``outs`` (hidden states pooled, or running-mean per token)."""
    if granularity == "sequence":
        pooled = pooled_hidden(outs.hidden, req.lengths) if outs.hidden is not None else None
        feats = sequence_features(layout, req.lengths, req.domains, pooled)
    else:
        hidden = outs.hidden[:, :-1] if outs.hidden is not None else None
        feats = token_features(layout, hidden, req.mask, req.domains)
    return RoutingSet(feats, outs.logp, req.mask, req.lengths, cost, req.domains)


@dataclass
class TrainResult:
    router: HybridRouter
    history: list[dict[str, float]]
    steps: int


def train_router(
    data: RoutingSet,
    *,
    costly: int,
    loss: HybridLossSpec,
    hidden: int = 16,
    utility_head: bool = False,
    epochs: int = 20,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
) -> TrainResult:
    """Adam on the router only (experts frozen: their outputs are cached in ``data``); deterministic for a seed."""
    torch.manual_seed(seed)
    k = data.logp.shape[1]
    router = HybridRouter(data.features.shape[-1], hidden, k, utility_head)
    flat = data.features[data.mask.bool()] if data.per_token else data.features
    router.set_normalisation(flat)
    opt = torch.optim.Adam(router.parameters(), lr=lr)
    target = data.utility_target(costly) if utility_head else None
    g = torch.Generator().manual_seed(seed)
    n = data.features.shape[0]
    history: list[dict[str, float]] = []
    steps = 0
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=g)
        sums: dict[str, float] = {}
        for i in range(0, n, batch_size):
            idx = perm[i : i + batch_size]
            logits, util = router(data.features[idx])
            terms = hybrid_loss(
                expert_logp=data.logp[idx],
                mask=data.mask[idx],
                scores=torch.softmax(logits, dim=-1),
                costly=costly,
                lambda_balance=loss.lambda_balance,
                balance=loss.balance,
                lambda_penalty=loss.lambda_penalty,
                threshold=loss.threshold,
                cost=data.cost[idx],
                cost_weight=loss.cost_weight,
                utility_pred=util,
                utility_target=target[idx] if target is not None else None,
                utility_weight=loss.utility_weight,
            )
            opt.zero_grad(set_to_none=True)
            terms.total.backward()
            opt.step()
            steps += 1
            for key, v in (
                ("loss", float(terms.total.detach())),
                ("ce", terms.ce),
                ("balance", terms.balance),
                ("penalty", terms.penalty),
                ("cost", terms.cost),
                ("utility", terms.utility),
            ):
                sums[key] = sums.get(key, 0.0) + v * idx.numel() / n
        history.append({"epoch": epoch + 1, **{key: round(v, 6) for key, v in sums.items()}})
    router.eval()
    return TrainResult(router, history, steps)


def route(
    router: HybridRouter, data: RoutingSet, *, costly: int, decision: str = "argmax", utility_threshold: float = 0.0
) -> torch.Tensor:
    """Hard choices: ``[N]`` per request or ``[N, T-1]`` per token."""
    with torch.no_grad():
        if decision == "utility":
            return router.choose(data.features, costly=costly, utility_threshold=utility_threshold)
        return router.choose(data.features)


def soft_nll(router: HybridRouter, data: RoutingSet) -> float:
    """Mean NLL per token of the soft mixture (what training optimises; deployment uses the hard choice)."""
    with torch.no_grad():
        return float(mixture_nll(data.logp, data.mask, router.scores(data.features)))


def oracle_choice(data: RoutingSet, costly: int) -> torch.Tensor:
    """The oracle router: for each request, the expert with the lowest mean NLL per token on that request (ties go
    to the cheap expert). It knows the answer, so its NLL is the floor for top-1 per-request routing; it ignores
    latency. Per token: the expert that gave the higher probability to each target token."""
    cheap = 1 - costly
    if data.per_token:
        return torch.where(data.logp[:, costly] > data.logp[:, cheap], costly, cheap)
    nll = data.seq_nll()
    return torch.where(nll[:, costly] < nll[:, cheap], costly, cheap)


def evaluate_choice(data: RoutingSet, choice: torch.Tensor, costly: int, *, alone: bool = False) -> ChoiceFigures:
    """Quality and expected latency of hard routing ``choice`` (``[N]`` or ``[N, T-1]``).

    nll: mean NLL per real token of the chosen experts; costly_share: share of routing units (requests, or tokens)
    sent to the costly expert; expected_latency_ms: mean over requests of the fitted latency of the experts that run
    (per token: every expert, since each must keep its state over the whole prefix; ``alone``: a baseline that runs
    only the expert it names, with no router).
    """
    k = data.logp.shape[1]
    m = data.mask
    if choice.dim() == 1:
        chosen = data.logp.gather(1, choice[:, None, None].expand(-1, 1, m.shape[1])).squeeze(1)
        share = float((choice == costly).float().mean())
        latency = data.cost.gather(1, choice[:, None]).squeeze(1)
        per_expert_len = {
            i: float(data.lengths[choice == i].float().mean()) if bool((choice == i).any()) else None for i in range(k)
        }
    else:
        chosen = data.logp.gather(1, choice[:, None, :]).squeeze(1)
        share = float(((choice == costly).float() * m).sum() / m.sum())
        latency = data.cost.gather(1, choice[:, :1]).squeeze(1) if alone else data.cost.sum(1)
        per_expert_len = {i: None for i in range(k)}
    nll = float(-(chosen * m).sum() / m.sum())
    by_domain = {}
    if choice.dim() == 1 and data.domains.numel():
        for d in sorted(set(data.domains.tolist())):
            sel = data.domains == d
            by_domain[int(d)] = float((choice[sel] == costly).float().mean())
    return ChoiceFigures(
        nll=nll,
        perplexity=math.exp(nll),
        costly_share=share,
        expected_latency_ms=float(latency.mean()),
        mean_length_by_expert=per_expert_len,
        costly_share_by_domain=by_domain,
    )
