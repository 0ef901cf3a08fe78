"""Bi-level training: each phase moves only its own parameters, reads only its own split, and gradients never leak
between the two objectives (unless the reference code's behaviour is asked for)."""

from __future__ import annotations

import pytest
import torch
from comigs_fixtures import recipe, tiny_base, user_data

from moetool.methods.comigs.federated import prepare

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("comigs-bilevel"))


def _snap(model, names):
    named = dict(model.named_parameters())
    return {n: named[n].detach().clone() for n in names}


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_expert_steps_leave_routers_and_router_steps_leave_experts(base):
    r = recipe(base, specialists=(2,))
    c = prepare(r, data=user_data(1)).clients[0]
    c.expert_step()  # give B non-zero values so every expert gradient is live
    routers, experts = _snap(c.model, c.router_names), _snap(c.model, c.expert_names)
    c.expert_step()
    assert _same(routers, _snap(c.model, c.router_names))
    assert not _same(experts, _snap(c.model, c.expert_names))
    assert all(p.grad is None for p in c.router_params)  # no router gradient is even computed
    routers, experts = _snap(c.model, c.router_names), _snap(c.model, c.expert_names)
    c.router_step(0)
    assert _same(experts, _snap(c.model, c.expert_names))
    assert not _same(routers, _snap(c.model, c.router_names))
    assert all(p.grad is None for p in c.expert_params)
    # and the base never moves
    base_names = [n for n, _ in c.model.named_parameters() if n not in c.expert_names + c.router_names]
    assert base_names and all(not dict(c.model.named_parameters())[n].requires_grad for n in base_names)


def test_reference_gradient_quirk_is_reproduced_only_when_asked(base):
    r = recipe(base, specialists=(2,), mimic_reference_gradients=True)
    c = prepare(r, data=user_data(1)).clients[0]
    c.expert_step()
    c.expert_step()
    # as in the reference code: expert steps build up router gradients ...
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in c.router_params)
    c.router_step(0)
    # ... and a router step leaves gradients on the experts that the next expert step adds to its own
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in c.expert_params)


def test_router_steps_read_only_validation_data_every_tau_iterations(base):
    r = recipe(base, specialists=(1,), rounds=3, local_iterations=4, router_every=3, router_steps=2)
    fed = prepare(r, data=user_data(1))
    c = fed.clients[0]
    seen: list[tuple[str, torch.Tensor]] = []
    phase = {"now": ""}
    c.model.register_forward_pre_hook(
        lambda m, args, kw: seen.append((phase["now"], kw["input_ids"])), with_kwargs=True
    )
    step_e, step_r = c.expert_step, c.router_step

    def expert_step():
        phase["now"] = "experts"
        return step_e()

    def router_step(i):
        phase["now"] = "routers"
        return step_r(i)

    c.expert_step, c.router_step = expert_step, router_step
    for _ in range(3):
        c.local_round()
    router_ids = torch.cat([ids.flatten() for p, ids in seen if p == "routers"])
    expert_ids = torch.cat([ids.flatten() for p, ids in seen if p == "experts"])
    bos = fed.tokenizer.bos_token_id
    router_ids, expert_ids = router_ids[router_ids != bos], expert_ids[expert_ids != bos]
    assert ((router_ids >= 150) & (router_ids < 250)).all()  # validation ids only
    assert (expert_ids < 150).all()  # train ids only
    # 12 expert iterations, τ = 3: router updates after iterations 3, 6, 9, 12, each of s = 2 steps
    order = [(p, s) for p, s, _ in c.reads]
    assert order.count(("routers", "valid")) == 8 and order.count(("experts", "train")) == 12
    positions = [i for i, (p, _) in enumerate(order) if p == "routers"]
    assert positions == [3, 4, 8, 9, 13, 14, 18, 19]


def test_tr_ablation_trains_routers_on_the_train_split(base):
    from moetool.methods.comigs.federated import variant_recipe

    r = variant_recipe(recipe(base, specialists=(1,), router_every=1, router_steps=1), "tr")
    c = prepare(r, data=user_data(1)).clients[0]
    c.local_round(2)
    assert {s for p, s, _ in c.reads if p == "routers"} == {"train"}


def test_private_state_restores_training_exactly(base):
    r = recipe(base, specialists=(2,), router_every=2, router_steps=1)
    data = user_data(1)
    a = prepare(r, data=data).clients[0]
    a.local_round()
    tensors, counters = a.private_state()
    b = prepare(r, data=data).clients[0]
    b.restore(tensors, counters)
    a.local_round()
    b.local_round()
    sa, sb = _snap(a.model, a.expert_names + a.router_names), _snap(b.model, b.expert_names + b.router_names)
    assert _same(sa, sb)
