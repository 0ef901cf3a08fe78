"""CoMiGS routing maths: top-k renormalisation, the k = n case, one expert, eq. 6 load balancing."""

from __future__ import annotations

import pytest
import torch
from comigs_fixtures import recipe, tiny_base
from transformers import AutoModelForCausalLM

from moetool.methods.comigs.assemble import build_user_model
from moetool.methods.comigs.bilevel import balance_loss
from moetool.methods.comigs.model import route
from moetool.routing.losses import load_balancing_loss

torch.set_num_threads(1)


def test_topk_weights_renormalise_over_the_chosen_experts():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5], [0.0, 3.0, 3.5, -2.0]])
    w, idx = route(logits, 2)
    assert idx.tolist() == [[0, 3], [2, 1]]
    assert torch.allclose(w.sum(-1), torch.ones(2))
    # equal to Mixtral's rule: softmax over all experts, keep the top-k, renormalise
    p = logits.softmax(-1)
    mix = p.gather(1, idx) / p.gather(1, idx).sum(-1, keepdim=True)
    assert torch.allclose(w, mix, atol=1e-7)
    # and the ratio of the two weights is exp of the logit gap
    assert torch.allclose(w[:, 0] / w[:, 1], (logits.gather(1, idx[:, :1]) - logits.gather(1, idx[:, 1:])).exp()[:, 0])


def test_k_equal_n_is_the_plain_softmax():
    logits = torch.randn(5, 2)
    w, idx = route(logits, 2)
    dense = torch.zeros_like(logits).scatter(-1, idx, w)
    assert torch.allclose(dense, logits.softmax(-1), atol=1e-7)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    base = tiny_base(tmp_path_factory.mktemp("comigs-routing"))
    return base, AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()


def _perturb(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".mlp.experts." in n or ".mlp.router." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_moe_layer_is_the_weighted_sum_of_whole_expert_mlps(dense):
    base, d = dense
    r = recipe(base, specialists=(3,))
    model = build_user_model(r, r.users[0], d).eval()
    _perturb(model)
    moe = model.moe_layers[0]
    x = torch.randn(1, 7, 32)
    with torch.no_grad():
        got = moe(x)[0]
        flat = x[0]
        logits = flat @ moe.router.weight.T  # [7, 4]
        top, idx = logits.topk(2, -1)
        w = top.softmax(-1)
        want = torch.zeros_like(flat)
        for t in range(7):
            for slot in range(2):
                j = int(idx[t, slot])
                e = moe.experts[j]
                s = moe.scaling
                g = moe.base.gate_proj.weight + s * e.gate_proj_B @ e.gate_proj_A
                u = moe.base.up_proj.weight + s * e.up_proj_B @ e.up_proj_A
                dn = moe.base.down_proj.weight + s * e.down_proj_B @ e.down_proj_A
                h = torch.nn.functional.silu(flat[t] @ g.T) * (flat[t] @ u.T)  # the activation sits between
                want[t] += w[t, slot] * (h @ dn.T)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_one_expert_has_no_router_and_is_that_expert(dense):
    base, d = dense
    r = recipe(base, specialists=(0,))
    model = build_user_model(r, r.users[0], d).eval()
    assert model.config.experts_per_token == 1 and all(m.router is None for m in model.moe_layers)
    _perturb(model)
    moe = model.moe_layers[1]
    x = torch.randn(5, 32)
    with torch.no_grad():
        ref = moe.expert_forward(x, 0, moe.base.gate_proj(x), moe.base.up_proj(x))
        assert torch.allclose(moe(x[None])[0], ref, atol=1e-6)


def test_rslora_scaling_is_alpha_over_sqrt_rank(dense):
    base, d = dense
    r = recipe(base)
    model = build_user_model(r, r.users[0], d)
    assert model.moe_layers[0].scaling == pytest.approx(16 / 4**0.5)
    assert model.lm.model.layers[0].self_attn.q_proj.scaling == pytest.approx(16 / 2**0.5)


def test_eq6_generalist_favoured_weights_and_optimum():
    n = 4
    logits = torch.randn(64, n)
    got = balance_loss(logits, 2, 1, "generalist_favoured")
    p = logits.softmax(-1).mean(0)
    f = torch.nn.functional.one_hot(logits.topk(2, -1).indices, n).sum(1).float().mean(0)
    denom = (n - 1) ** 2 + 1
    want = f[0] * p[0] / denom + ((n - 1) / denom) * (f[1:] * p[1:]).sum()
    assert torch.allclose(got, want)

    # the paper's aim: with P_0 = 1/2 and the rest equal, the loss is lower than with uniform routing
    def value(p0):
        rest = (1 - p0) / (n - 1)
        probs = torch.tensor([[p0] + [rest] * (n - 1)]).log()
        return float(balance_loss(probs.expand(8, n), 1, 1, "generalist_favoured"))

    assert value(0.5) < value(0.25) and value(0.5) < value(0.8)


def test_uniform_is_the_switch_loss_and_constant_for_1g1s():
    logits = torch.randn(50, 3)
    assert torch.allclose(balance_loss(logits, 2, 1, "uniform"), load_balancing_loss(logits, 2))
    assert torch.allclose(balance_loss(logits, 2, 2, "generalist_favoured"), load_balancing_loss(logits, 2))
    # n = k = 2: every token takes both experts, f = (1, 1), so eq. 6 is 0.5 · ΣP = 0.5 whatever the router does
    for _ in range(3):
        assert float(balance_loss(torch.randn(20, 2) * 5, 2, 1, "generalist_favoured")) == pytest.approx(0.5)
