"""Federated averaging: generalists identical everywhere after a round, specialists and routers never touched, and
only generalist (and shared attention) tensors are ever uploaded."""

from __future__ import annotations

import pytest
import torch
from comigs_fixtures import recipe, tiny_base, user_data

from moetool.methods.comigs.federated import average, prepare, run_inprocess, variant_recipe

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("comigs-fed"))


def _private(c):
    named = dict(c.model.named_parameters())
    return {n: named[n].detach().clone() for n in c.expert_names + c.router_names if n not in c.shared}


def test_upload_holds_only_generalists_and_attention_lora(base):
    r = recipe(base, specialists=(1, 3))
    fed = prepare(r, data=user_data(2))
    for c in fed.clients:
        up = c.shared_state()
        assert up and all(
            ".mlp.experts.0." in n or (".self_attn." in n and n.endswith((".lora_A", ".lora_B"))) for n in up
        )
        assert not any(".router." in n or ".mlp.experts.1." in n for n in up)
        n_layers = 2
        assert len(up) == n_layers * (3 * 2 + 4 * 2)  # generalist A/B on gate/up/down + attention A/B on q/k/v/o
    # users with different numbers of specialists still share identically shaped uploads
    a, b = (c.shared_state() for c in fed.clients)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    local_attn = r.model_copy(update={"lora": r.lora.model_copy(update={"share_attention": False})})
    c = prepare(local_attn, data=user_data(2)).clients[0]
    assert all(".mlp.experts.0." in n for n in c.shared_state())


def test_after_a_round_generalists_are_identical_and_private_parts_untouched(base):
    r = recipe(base, specialists=(1, 3), rounds=1, router_every=1, router_steps=1)
    fed = prepare(r, data=user_data(2))
    c0, c1 = fed.clients
    # one round by hand, so the uploads can be checked against the broadcast
    for c in fed.clients:
        c.local_round()
    uploads = [c.shared_state() for c in fed.clients]
    assert not all(torch.equal(uploads[0][k], uploads[1][k]) for k in uploads[0])  # users trained apart
    private = [_private(c) for c in fed.clients]
    server = average(uploads)
    for c in fed.clients:
        c.load_shared(server)
    for k in server:
        assert torch.equal(server[k], (uploads[0][k] + uploads[1][k]) / 2)  # uniform, not data-weighted
        assert torch.equal(c0.shared_state()[k], c1.shared_state()[k])
    for c, before in zip(fed.clients, private, strict=True):
        after = _private(c)
        assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
        assert any(".router." in n for n in before) and any(".mlp.experts.1." in n for n in before)


def test_runner_ends_with_one_generalist_and_distinct_specialists(base):
    r = recipe(base, specialists=(1, 1))
    fed = run_inprocess(prepare(r, data=user_data(2)))
    a, b = (c.shared_state() for c in fed.clients)
    assert all(torch.equal(a[k], b[k]) for k in a)
    pa, pb = (dict(c.model.named_parameters()) for c in fed.clients)
    spec = "lm.model.layers.0.mlp.experts.1.up_proj_B"
    assert not torch.equal(pa[spec], pb[spec])
    assert len(fed.history) == r.training.rounds


def test_baselines_share_what_the_paper_says(base):
    r = recipe(base, specialists=(1, 1))
    shared = {}
    for v in ("comigs", "2S", "2G", "local", "fedavg"):
        fed = prepare(variant_recipe(r, v), data=user_data(2))
        c = fed.clients[0]
        shared[v] = {n.split(".mlp.experts.")[1].split(".")[0] for n in c.shared if ".mlp.experts." in n}
        assert c.model.config.n_experts == 2
        has_router = bool(c.router_names)
        assert has_router == (v not in ("local", "fedavg"))
    assert shared == {"comigs": {"0"}, "2S": set(), "2G": {"0", "1"}, "local": set(), "fedavg": {"0", "1"}}


def test_server_tensors_are_checked(base):
    r = recipe(base, specialists=(1,))
    c = prepare(r, data=user_data(1)).clients[0]
    state = c.shared_state()
    with pytest.raises(ValueError, match="does not share"):
        c.load_shared(state | {"lm.model.layers.0.mlp.router.weight": torch.zeros(2, 32)})
    with pytest.raises(ValueError, match="did not send"):
        c.load_shared(dict(list(state.items())[1:]))
    with pytest.raises(ValueError, match="different tensors"):
        average([state, dict(list(state.items())[1:])])


def test_builds_are_deterministic_and_start_from_the_server_generalist(base):
    # a device rebuilt from the recipe (as Flower does each round) must be bitwise the same model
    r = recipe(base, specialists=(1, 2))
    a, b = prepare(r, data=user_data(2)).clients, prepare(r, data=user_data(2)).clients
    for ca, cb in zip(a, b, strict=True):
        pa, pb = dict(ca.model.named_parameters()), dict(cb.model.named_parameters())
        assert all(torch.equal(pa[n], pb[n]) for n in pa)
        assert all(float(pa[n].abs().max()) == 0.0 for n in ca.router_names)  # uniform routing at the start
    g0, g1 = a[0].shared_state(), a[1].shared_state()
    assert all(torch.equal(g0[k], g1[k]) for k in g0)  # every device starts from the same generalist
    p0, p1 = dict(a[0].model.named_parameters()), dict(a[1].model.named_parameters())
    spec = "lm.model.layers.0.mlp.experts.1.gate_proj_A"
    assert not torch.equal(p0[spec], p1[spec])  # specialists are seeded by their own names
