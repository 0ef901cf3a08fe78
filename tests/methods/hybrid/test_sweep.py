"""A synthetic two-expert task: raising λ2 (or lowering T_u's slack) moves the costly-expert share monotonically."""

from __future__ import annotations

import itertools

import torch

from moetool.methods.hybrid.training import RoutingSet, evaluate_choice, oracle_choice, route, train_router
from moetool.recipe.hybrid import HybridLossSpec

COSTLY = 1


def synthetic(n: int = 256, t: int = 8, seed: int = 0) -> RoutingSet:
    """Short requests gain from the costly expert (up to +1.5 nats/token), long ones lose (down to -1.5)."""
    g = torch.Generator().manual_seed(seed)
    length = torch.rand(n, generator=g)
    noise = torch.randn(n, 1, generator=g)
    gain = 1.5 - 3.0 * length
    cheap = torch.full((n, t), -3.0)
    costly = cheap + gain[:, None] + 0.1 * torch.randn(n, t, generator=g)
    logp = torch.stack([cheap, costly], dim=1).clamp(max=-0.01)
    lengths = (length * 255 + 1).round().long()
    cost = torch.stack([0.1 * lengths.float(), 0.5 * lengths.float()], dim=1)
    feats = torch.cat([length[:, None], noise], dim=1)
    return RoutingSet(feats, logp, torch.ones(n, t), lengths, cost)


def _share(data: RoutingSet, **loss) -> tuple[float, float]:
    res = train_router(data, costly=COSTLY, loss=HybridLossSpec(**loss), hidden=16, epochs=25, lr=1e-2, seed=0)
    ev = evaluate_choice(data, route(res.router, data, costly=COSTLY), COSTLY)
    return ev["costly_share"], ev["nll"]


def test_raising_lambda2_lowers_costly_share_monotonically():
    data = synthetic()
    shares = [_share(data, lambda_penalty=lam)[0] for lam in (0.0, 0.5, 2.0, 8.0)]
    assert all(a >= b for a, b in itertools.pairwise(shares)), shares
    assert shares[0] > 0.4 and shares[-1] < 0.1, shares  # from ~the oracle's half to almost none
    oracle = evaluate_choice(data, oracle_choice(data, COSTLY), COSTLY)
    assert abs(oracle["costly_share"] - 0.5) < 0.06  # gain > 0 exactly for length < 0.5
    assert abs(shares[0] - oracle["costly_share"]) < 0.1  # with λ2 = 0 the router finds the oracle's split


def test_cost_weight_lowers_costly_share_and_quality_trades_off():
    data = synthetic()
    free, priced = _share(data, cost_weight=0.0), _share(data, cost_weight=0.05)
    assert priced[0] < free[0] and priced[1] > free[1]  # fewer costly requests, worse NLL


def test_per_token_routing_trains_and_evaluates():
    data = synthetic(n=128)
    per_token = RoutingSet(data.features[:, None, :].expand(-1, 8, -1), data.logp, data.mask, data.lengths, data.cost)
    res = train_router(per_token, costly=COSTLY, loss=HybridLossSpec(lambda_penalty=0.0), epochs=30, lr=1e-2)
    choice = route(res.router, per_token, costly=COSTLY)
    assert choice.shape == (128, 8)
    ev = evaluate_choice(per_token, choice, COSTLY)
    # both experts keep state over every prefix: per-token latency is the sum of both experts'
    assert ev["expected_latency_ms"] == float(data.cost.sum(1).mean())
    assert 0.3 < ev["costly_share"] < 0.7


def test_utility_head_learns_the_costly_experts_gain():
    data = synthetic(n=256)
    res = train_router(
        data,
        costly=COSTLY,
        loss=HybridLossSpec(lambda_penalty=0.0, lambda_balance=0.0),
        hidden=16,
        utility_head=True,
        epochs=25,
        lr=1e-2,
        seed=0,
    )
    with torch.no_grad():
        _, pred = res.router(data.features)
    target = data.utility_target(COSTLY)
    assert torch.corrcoef(torch.stack([pred, target]))[0, 1] > 0.95
    # "costly if predicted gain > tau": a higher tau sends fewer requests to the costly expert
    shares = [
        evaluate_choice(
            data, route(res.router, data, costly=COSTLY, decision="utility", utility_threshold=tau), COSTLY
        )["costly_share"]
        for tau in (-0.5, 0.0, 0.5, 1.0)
    ]
    assert all(a >= b for a, b in itertools.pairwise(shares)) and shares[0] > shares[-1], shares
    assert abs(shares[1] - 0.5) < 0.1  # tau = 0 is the oracle's split (gain > 0)
