"""Routing losses against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from moetool.routing.losses import expert_load, load_balancing_loss, router_z_loss, routing_entropy

L3, L2, L5 = math.log(3), math.log(2), math.log(5)


def test_balance_loss_is_one_when_balanced():
    # probs [.25, .75] and [.75, .25]: top-1 sends one token to each expert; f = P = [.5, .5]; 2 * (.25 + .25)
    logits = torch.tensor([[0.0, L3], [L3, 0.0]])
    assert load_balancing_loss(logits, 1).item() == pytest.approx(1.0)


def test_balance_loss_when_skewed():
    # both tokens to expert 1: f = [0, 1], P = [.25, .75]; 2 * .75
    logits = torch.tensor([[0.0, L3], [0.0, L3]])
    assert load_balancing_loss(logits, 1).item() == pytest.approx(1.5)


def test_balance_loss_top2():
    # probs [1/8, 2/8, 5/8]; top-2 = experts 2 and 1: f = [0, .5, .5]; 3 * (.5 * .25 + .5 * .625) = 1.3125
    logits = torch.tensor([[0.0, L2, L5]])
    assert load_balancing_loss(logits, 2).item() == pytest.approx(1.3125)


def test_balance_loss_gradient_flows_through_probabilities_only():
    logits = torch.tensor([[0.0, L3], [0.0, L3]], requires_grad=True)
    load_balancing_loss(logits, 1).backward()
    # d/dlogit of 2 * mean_t p1(t) with p1 = .75: 2 * .5 * p1 * (1 - p1) per token
    assert logits.grad[0, 1].item() == pytest.approx(2 * 0.5 * 0.75 * 0.25)


def test_z_loss():
    # logsumexp: [0, ln3] -> ln 4; [0, 0] -> ln 2; mean of squares = ((2 ln2)^2 + (ln2)^2) / 2
    logits = torch.tensor([[0.0, L3], [0.0, 0.0]])
    assert router_z_loss(logits).item() == pytest.approx(2.5 * math.log(2) ** 2)


def test_entropy_and_load():
    assert routing_entropy(torch.zeros(4, 2)).item() == pytest.approx(math.log(2))
    load = expert_load(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]), 2)
    assert load.tolist() == pytest.approx([0.25, 0.5, 0.25])
