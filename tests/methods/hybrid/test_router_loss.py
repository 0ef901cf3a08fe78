"""Hybrid router and loss: parameter counts, hand-computed loss terms, gradient signs, hard == argmax of soft."""

from __future__ import annotations

import math

import pytest
import torch

from moetool.methods.hybrid.loss import costly_hinge, expected_cost, hybrid_loss, kl_uniform, mixture_nll
from moetool.methods.hybrid.router import (
    FeatureLayout,
    HybridRouter,
    domain_feature,
    router_param_count,
    sequence_features,
    token_features,
)


@pytest.mark.parametrize(
    ("layout", "hidden", "utility", "expected"),
    [
        (FeatureLayout(True, 1, 0, 256), 16, False, 82),  # the paper's [l, d] -> 16 -> 2: 82, not "~1.3K"
        (FeatureLayout(True, 3, 128, 256), 16, False, 132 * 16 + 16 + 16 * 2 + 2),
        (FeatureLayout(True, 3, 128, 256), 16, True, 132 * 16 + 16 + 16 * 2 + 2 + 17),
        (FeatureLayout(True, 1, 0, 256), 0, False, 2 * 2 + 2),  # Eq. 9: one linear layer
        (FeatureLayout(False, 0, 768, 512), 16, False, 768 * 16 + 16 + 34),
    ],
)
def test_router_parameter_count_closed_form(layout, hidden, utility, expected):
    router = HybridRouter(layout.width, hidden, 2, utility)
    assert router_param_count(layout.width, hidden, 2, utility) == expected
    assert router.trainable_parameters() == expected


def test_features_layout_and_values():
    layout = FeatureLayout(length=True, n_domains=3, hidden_dim=2, max_length=100)
    pooled = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    x = sequence_features(layout, torch.tensor([50, 400]), torch.tensor([2, -1]), pooled)
    assert x.tolist() == [[0.5, 0, 0, 1, 1, 2], [1.0, 0, 0, 0, 3, 4]]  # length clips at max; unknown domain is zero
    assert domain_feature(torch.tensor([0]), 3).tolist() == [[1, 0, 0]]
    hidden = torch.tensor([[[2.0, 0.0], [4.0, 2.0], [9.0, 9.0]]])
    tok = token_features(layout, hidden, torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([0]))
    assert tok.shape == (1, 3, 6)
    assert tok[0, :2, 0].tolist() == pytest.approx([0.01, 0.02]) and tok[0, 1, 4:].tolist() == [
        3.0,
        1.0,
    ]  # causal running mean


def test_hard_dispatch_is_argmax_of_soft_scores():
    torch.manual_seed(0)
    router = HybridRouter(5, 16, 2)
    x = torch.randn(512, 5) * 3
    assert torch.equal(router.choose(x), router.scores(x).argmax(-1))
    # with two experts, argmax == "costly score > 0.5" == logit difference > 0 (the paper's tau is just the bias)
    logits, _ = router(x)
    assert torch.equal(router.choose(x) == 1, router.scores(x)[:, 1] > 0.5)
    assert torch.equal(router.choose(x) == 1, logits[:, 1] - logits[:, 0] > 0)
    per_token = torch.randn(4, 7, 5)
    assert torch.equal(router.choose(per_token), router.scores(per_token).argmax(-1))


def test_utility_rule():
    router = HybridRouter(3, 8, 2, utility_head=True)
    x = torch.randn(64, 3)
    _, util = router(x)
    got = router.choose(x, costly=0, utility_threshold=0.1)
    assert torch.equal(got, torch.where(util > 0.1, 0, 1))
    with pytest.raises(ValueError, match="utility head"):
        HybridRouter(3, 8, 2).choose(x, costly=0, utility_threshold=0.1)


def test_loss_terms_hand_computed():
    scores = torch.tensor([[0.9, 0.1], [0.3, 0.7]])
    # KL(S||U) = sum S log(2 S)
    kl = ((0.9 * math.log(1.8) + 0.1 * math.log(0.2)) + (0.3 * math.log(0.6) + 0.7 * math.log(1.4))) / 2
    assert float(kl_uniform(scores)) == pytest.approx(kl, rel=1e-6)
    assert float(kl_uniform(torch.full((3, 2), 0.5))) == pytest.approx(0.0, abs=1e-7)
    # hinge on the costly expert (index 1), T_u = 0.08: max(0, .1-.08) and max(0, .7-.08)
    assert float(costly_hinge(scores, 1, 0.08)) == pytest.approx((0.02 + 0.62) / 2, rel=1e-6)
    cost = torch.tensor([[1.0, 10.0], [2.0, 20.0]])
    assert float(expected_cost(scores, cost)) == pytest.approx(((0.9 + 1.0) + (0.6 + 14.0)) / 2, rel=1e-6)
    # mixture CE: -log(S_0 p_0 + S_1 p_1) per token, mean over real tokens
    p = torch.tensor([[[0.5, 0.2, 0.9], [0.25, 0.8, 0.9]], [[0.1, 0.1, 0.1], [0.6, 0.3, 0.1]]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    want = [-math.log(0.9 * 0.5 + 0.1 * 0.25), -math.log(0.9 * 0.2 + 0.1 * 0.8)]
    want += [-math.log(0.3 * 0.1 + 0.7 * 0.6), -math.log(0.3 * 0.1 + 0.7 * 0.3), -math.log(0.3 * 0.1 + 0.7 * 0.1)]
    assert float(mixture_nll(p.log(), mask, scores)) == pytest.approx(sum(want) / 5, rel=1e-6)
    terms = hybrid_loss(expert_logp=p.log(), mask=mask, scores=scores, costly=1, cost=cost, cost_weight=0.01)
    total = sum(want) / 5 + 1.0 * kl + 0.5 * (0.64 / 2) + 0.01 * (16.5 / 2)
    assert float(terms.total) == pytest.approx(total, rel=1e-6)
    assert terms.ce == pytest.approx(sum(want) / 5, rel=1e-6) and terms.cost == pytest.approx(8.25, rel=1e-6)


def test_per_token_scores_weight_padding_out():
    logp = torch.log(torch.tensor([[[0.5, 0.1], [0.25, 0.9]]]))
    mask = torch.tensor([[1.0, 0.0]])
    scores = torch.tensor([[[0.5, 0.5], [0.0001, 0.9999]]])
    assert float(mixture_nll(logp, mask, scores)) == pytest.approx(-math.log(0.375), rel=1e-6)
    assert float(kl_uniform(scores, mask)) == pytest.approx(0.0, abs=1e-6)  # only the real token counts


def _grad_wrt_logit(fn, s_costly):
    z = torch.tensor([0.0, math.log(s_costly / (1 - s_costly))], requires_grad=True)
    fn(torch.softmax(z, -1).unsqueeze(0)).backward()
    return float(z.grad[1])


def test_balance_gradient_sign_points_to_uniform():
    # Descending KL(S||U) must move the costly score toward 0.5 from either side; the paper's Eq. 16 (= -KL) would
    # push it away.
    assert _grad_wrt_logit(kl_uniform, 0.9) > 0  # gradient descent lowers the costly logit
    assert _grad_wrt_logit(kl_uniform, 0.1) < 0  # ... and raises it when below uniform
    assert _grad_wrt_logit(lambda s: -kl_uniform(s), 0.9) < 0  # the paper's sign: the wrong way
    # the hinge only pushes the costly score down, and only above T_u
    assert _grad_wrt_logit(lambda s: costly_hinge(s, 1, 0.08), 0.3) > 0
    assert _grad_wrt_logit(lambda s: costly_hinge(s, 1, 0.08), 0.05) == 0


def test_bad_balance_name():
    s = torch.full((1, 2), 0.5)
    with pytest.raises(ValueError, match="balance"):
        hybrid_loss(expert_logp=torch.zeros(1, 2, 1), mask=torch.ones(1, 1), scores=s, costly=1, balance="entropy")
