"""Freeze presets and patterns select exactly the intended tensors."""

from __future__ import annotations

import pytest
from transformers import MixtralConfig, MixtralForCausalLM

from moetool.train.freeze import FreezeError, apply_freeze


@pytest.fixture
def moe():
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
    )
    return MixtralForCausalLM(cfg)


def _trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_mofe_preset(moe):
    rep = apply_freeze(moe, "mofe")
    names = {n for n, _ in moe.named_parameters()}
    experts = {n for n in names if ".mlp.experts." in n}
    assert experts == {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    assert _trainable(moe) == names - experts
    assert rep.frozen_params == sum(p.numel() for n, p in moe.named_parameters() if n in experts)
    assert rep.trainable_params + rep.frozen_params == sum(p.numel() for p in moe.parameters())


def test_router_only(moe):
    apply_freeze(moe, "router_only")
    assert _trainable(moe) == {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"}


def test_user_patterns(moe):
    apply_freeze(moe, None, trainable=["model.layers.1.*"], frozen=["*.experts.*", "*layernorm*"])
    assert _trainable(moe) == {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        "model.layers.1.mlp.gate.weight"
    }


def test_pattern_matching_nothing_is_an_error(moe):
    with pytest.raises(FreezeError, match=r"freeze.trainable: pattern '\*.router.\*' matches no parameter"):
        apply_freeze(moe, "mofe", trainable=["*.router.*"])
    with pytest.raises(FreezeError, match="freeze.frozen: pattern 'nope' matches no parameter"):
        apply_freeze(moe, None, trainable=["*"], frozen=["nope"])


def test_nothing_trainable_is_an_error(moe):
    with pytest.raises(FreezeError, match="no parameter is left trainable"):
        apply_freeze(moe, None, trainable=["*.gate.weight"], frozen=["*"])


def test_trainable_count_constant_in_expert_count():
    counts = []
    for n in (2, 4, 8):
        cfg = MixtralConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=n,
        )
        rep = apply_freeze(MixtralForCausalLM(cfg), "mofe")
        counts.append(rep.trainable_params - 2 * n * 16)  # minus the router rows, which grow with n
    assert counts[0] == counts[1] == counts[2]


def test_router_learning_rate_group(moe):
    from moetool.recipe.train import TrainSpec
    from moetool.train.router_tuning import make_optimizer

    apply_freeze(moe, "mofe")
    opt = make_optimizer(moe, TrainSpec(learning_rate=1e-3, router_learning_rate=0.1))
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    params = dict(moe.named_parameters())
    assert lrs[id(params["model.layers.1.mlp.gate.weight"])] == 0.1
    assert lrs[id(params["model.layers.1.self_attn.q_proj.weight"])] == 1e-3
    assert id(params["model.layers.1.mlp.experts.down_proj"]) not in lrs
    apply_freeze(moe, "router_only")
    opt = make_optimizer(moe, TrainSpec(learning_rate=1e-3))
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == 1e-3
