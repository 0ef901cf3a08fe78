"""Router tuning: frozen tensors stay bitwise equal, resume equals an uninterrupted run, output loads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from tuning_fixtures import read_all_tensors, write_tuning_recipe

from moetool.api import assemble
from moetool.recipe import load_recipe
from moetool.train.router_tuning import checkpoint_dir, train_router


def _interrupt_at(n: int):
    """A training callback that stops the run (as Ctrl-C would) after step ``n``."""

    def interrupt(step, _metrics):
        if step == n:
            raise KeyboardInterrupt

    return interrupt


@pytest.fixture(scope="module")
def moe(tiny_models, tmp_path_factory):
    m = tiny_models("llama")
    d = tmp_path_factory.mktemp("train")
    recipe = write_tuning_recipe(d, m, steps=6, legal_jsonl=True)
    return load_recipe(recipe), assemble(recipe, d / "moe")


def test_trains_routers_and_freezes_experts(moe, tmp_path):
    recipe, src = moe
    res = train_router(recipe, src, tmp_path / "tuned")
    before, after = read_all_tensors(src), read_all_tensors(tmp_path / "tuned")
    assert set(before) == set(after)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "nothing trained"
    assert not any(".experts." in k for k in changed), "experts must be bitwise frozen under the mofe preset"
    assert any(k.endswith("block_sparse_moe.gate.weight") for k in changed)
    assert any("self_attn" in k for k in changed)
    assert res.freeze.trainable_params + res.freeze.frozen_params == sum(v.numel() for v in before.values())
    assert len(res.history) == 3 and all(len(h["load"]) == 3 for h in res.history)
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "tuned"))
    meta = json.loads((tmp_path / "tuned" / "moetool.json").read_text())
    assert meta["training"]["steps"] == 6 and meta["experts"] == ["a", "b", "c"]
    assert "## Router tuning" in (tmp_path / "tuned" / "README.md").read_text()
    assert not checkpoint_dir(tmp_path / "tuned").exists()


def test_resume_equals_uninterrupted(moe, tmp_path):
    recipe, src = moe
    train_router(recipe, src, tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        train_router(recipe, src, tmp_path / "resumed", callback=_interrupt_at(3))
    assert not (tmp_path / "resumed").exists()
    assert checkpoint_dir(tmp_path / "resumed").exists()
    res = train_router(recipe, src, tmp_path / "resumed")
    assert res.resumed_from == 2
    a, b = read_all_tensors(tmp_path / "straight"), read_all_tensors(tmp_path / "resumed")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_divergence_stops_with_a_named_error_and_writes_nothing(moe, tmp_path):
    """A learning rate of 1e30 used to train to NaN and write a model with half its tensors NaN, exit 0."""
    from moetool.errors import MoetoolError

    recipe, src = moe
    wild = recipe.model_copy(
        update={"train": recipe.train.model_copy(update={"learning_rate": 1e30, "router_learning_rate": 1e30})}
    )
    with pytest.raises(MoetoolError, match=r"router tuning diverged at step \d+ .*Nothing was written"):
        train_router(wild, src, tmp_path / "tuned")
    assert not (tmp_path / "tuned").exists()


def test_non_finite_learning_rate_is_a_recipe_error():
    from pydantic import ValidationError

    from moetool.recipe.train import TrainSpec

    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="learning_rate"):
            TrainSpec(learning_rate=bad)


def test_a_checkpoint_is_not_resumed_onto_another_model_at_the_same_path(moe, tmp_path, tiny_models):
    """Checkpoints are keyed by the model's content: a re-merged --model (same path, other content) is refused with
    the way out, not resumed into a crash."""
    import shutil

    from moetool.errors import MoetoolError

    recipe, src = moe
    model = tmp_path / "model"
    shutil.copytree(src, model)

    with pytest.raises(KeyboardInterrupt):
        train_router(recipe, model, tmp_path / "tuned", callback=_interrupt_at(2))
    assert checkpoint_dir(tmp_path / "tuned").exists()
    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6) * 2  # a different model now lives at the same path
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MoetoolError, match="belongs to a different run.*--no-resume"):
        train_router(recipe, model, tmp_path / "tuned")


@pytest.mark.parametrize("damage", ["truncated-tensors", "missing-moments", "state-garbage"])
def test_a_corrupt_checkpoint_is_named_with_the_way_out(moe, tmp_path, damage):
    """A checkpoint cut short (a kill or a full disk mid-save) is refused naming --no-resume, not a traceback."""
    from moetool.errors import MoetoolError

    recipe, src = moe

    with pytest.raises(KeyboardInterrupt):
        train_router(recipe, src, tmp_path / "tuned", callback=_interrupt_at(2))
    ckpt = checkpoint_dir(tmp_path / "tuned")
    if damage == "truncated-tensors":
        data = (ckpt / "trainable.safetensors").read_bytes()
        (ckpt / "trainable.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "missing-moments":
        (ckpt / "optimizer.safetensors").unlink()
    else:
        (ckpt / "state.json").write_text("{")
    with pytest.raises(MoetoolError, match="--no-resume"):
        train_router(recipe, src, tmp_path / "tuned")
    assert not (tmp_path / "tuned").exists()
    train_router(recipe, src, tmp_path / "tuned", resume=False)  # the way out works
