"""Adding a LoRA adapter (baked as peft bakes it), pruning's scores and budgets, router recalibration, and every bad
input refused by name with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TEXT, save_dense
from edit.test_proofs import PROMPTS, merge
from moetool import api
from moetool.edit.add import bake_adapter
from moetool.edit.layout import EditError, read_layout
from moetool.edit.prune import budget, choose
from moetool.edit.scoring import ExpertStats
from moetool.errors import OutputExistsError
from moetool.io.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def moe(tiny_models, tmp_path_factory) -> tuple[dict[str, Path], Path]:
    m = tiny_models("llama")
    return m, merge(tmp_path_factory.mktemp("moe"), m, "moe", "")


def lora_adapter(base: Path, out: Path, targets: list[str], *, seed: int = 0, rslora: bool = False) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_rslora=rslora))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    peft.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("rslora", [False, True])
def test_a_lora_adapter_bakes_as_peft_merges_it(moe, tmp_path, rslora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m, _ = moe
    adapter = lora_adapter(m["base"], tmp_path / "lora", ["gate_proj", "up_proj", "down_proj"], rslora=rslora)
    baked = Checkpoint(bake_adapter(adapter, m["base"], tmp_path / "baked"))
    model = AutoModelForCausalLM.from_pretrained(str(m["base"]), dtype=torch.float32)
    reference = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().state_dict()
    for name in baked.tensors:
        assert torch.allclose(baked.get(name), reference[name], atol=1e-6), name


def test_adding_a_lora_adapter(moe, tmp_path):
    m, merged = moe
    adapter = lora_adapter(m["base"], tmp_path / "lora", ["gate_proj", "up_proj", "down_proj"])
    result = api.experts.add(merged, adapter, tmp_path / "added", name="lora", prompts=["def main():"])
    assert read_layout(result.output).names == ("x1", "x2", "x3", "lora")
    assert result.parity["old_experts_vs_input"] <= 1e-5
    record = json.loads((result.output / "moetool.json").read_text())["edits"][-1]
    assert record["adapter_base"] == str(m["base"].resolve())  # from the adapter's own config
    assert not list(tmp_path.glob(".added.moetool-tmp-*"))  # the bake's scratch folder is gone


def test_an_attention_adapter_is_refused(moe, tmp_path):
    m, merged = moe
    adapter = lora_adapter(m["base"], tmp_path / "lora", ["q_proj", "gate_proj"])
    with pytest.raises(EditError, match=r"adapts .*q_proj; an expert is an MLP"):
        api.experts.add(merged, adapter, tmp_path / "out", name="lora", prompts=["x y"])
    assert not (tmp_path / "out").exists()


def test_bad_inputs_are_named_and_nothing_is_written(moe, tiny_models, tmp_path):
    m, merged = moe
    out = tmp_path / "out"
    with pytest.raises(EditError, match=r"no expert 'nope' \(experts: 0=x1, 1=x2, 2=x3\)"):
        api.experts.remove(merged, ["nope"], out)
    with pytest.raises(EditError, match="index 7 is out of range"):
        api.experts.extract(merged, "7", out)
    with pytest.raises(EditError, match=r"1 expert\(s\) would remain but the MoE routes each token to 2"):
        api.experts.remove(merged, ["x1", "x2"], out)
    with pytest.raises(EditError, match="would leave no expert"):
        api.experts.remove(merged, ["x1", "x2", "x3"], out, top_k=1)
    with pytest.raises(EditError, match="the MoE already has an expert 'x1'"):
        api.experts.add(merged, m["e1"], out, name="x1", prompts=["def"])
    other = save_dense(tmp_path / "other", "llama", hidden_size=64, intermediate_size=48)
    with pytest.raises(EditError, match="hidden_size is 64, the MoE has 32"):
        api.experts.add(merged, other, out, name="other", prompts=["def"])
    wide = save_dense(tmp_path / "wide", "llama", intermediate_size=64)
    with pytest.raises(EditError, match=r"has shape \[64, 32\]; the MoE's experts \[48, 32\]"):
        api.experts.add(merged, wide, out, name="wide", prompts=["def"])
    with pytest.raises(EditError, match="below the MoE's top-k"):
        api.experts.prune(merged, out, keep=1, by="reap", data={"t": str(merged / "moetool-recipe.yaml")})
    with pytest.raises(EditError, match="not an MoE"):
        api.experts.remove(m["base"], ["0"], out)
    with pytest.raises(EditError, match="overlaps the input"):
        api.experts.remove(merged, ["x1"], merged / "inside")
    with pytest.raises(EditError, match="--by 'size'"):
        api.experts.prune(merged, out, keep=2, by="size", data={})
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        api.experts.remove(merged, ["x1"], out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def _stats(counts: list[list[float]], reap: list[list[float]]) -> ExpertStats:
    c = torch.tensor(counts, dtype=torch.float64)
    return ExpertStats([0, 1], ["a", "b", "c", "d"], 2, int(c[0].sum() // 2), c, c.clone(), torch.tensor(reap) * c)


def test_reap_and_frequency_choose_differently():
    """Expert b is routed most but contributes least (REAP's point): frequency keeps it, REAP does not."""
    stats = _stats([[10, 40, 20, 10], [10, 40, 20, 10]], [[1.0, 0.01, 0.5, 0.8], [1.0, 0.01, 0.5, 0.8]])
    assert choose(stats, 2, "frequency").keep == {0: [1, 2], 1: [1, 2]}
    assert choose(stats, 2, "reap").keep == {0: [0, 3], 1: [0, 3]}
    per_layer = _stats([[10, 40, 20, 10], [40, 10, 10, 20]], [[1, 1, 1, 1], [1, 1, 1, 1]])
    assert choose(per_layer, 2, "frequency", per_layer=True).keep == {0: [1, 2], 1: [0, 3]}
    assert choose(stats, 2, "random", seed=1).keep == choose(stats, 2, "random", seed=1).keep


def test_budgets():
    assert budget(8, 0.5) == 4 and budget(8, 3) == 3 and budget(6, 3, power_of_two=True) == 2
    for bad, match in ((8, "pruning must keep fewer"), (0.01, "keeps no expert"), (2.5, "whole number")):
        with pytest.raises(EditError, match=match):
            budget(8, bad)
    for bad in (float("nan"), float("inf"), float("-inf"), -3, 0):  # int(nan), int(inf) raised; -3 kept "none"
        with pytest.raises(EditError, match=r"--keep .*: give a number of experts \(2, 3, …\) or a fraction"):
            budget(8, bad)


def test_prune_with_recalibration_writes_both_records(moe, tmp_path):
    _m, merged = moe
    text = tmp_path / "calib.txt"
    text.write_text(TEXT * 8)
    result = api.experts.prune(
        merged, tmp_path / "pruned", keep=2, by="reap", data={"mix": str(text)}, tune=api.experts.Recalibration(steps=2)
    )
    assert result.tuned and read_layout(result.output).n_experts == 2
    meta = json.loads((result.output / "moetool.json").read_text())
    assert meta["edits"][-1]["op"] == "prune" and meta["edits"][-1]["parity"]["vs_input_restricted"] <= 1e-5
    assert meta["training"]["freeze"]["preset"] == "router_only"
    card = (result.output / "README.md").read_text()
    assert "## Edits" in card and "## Router tuning" in card
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "pruned"]  # no scratch left


def test_add_with_prompts_routes_its_domain_to_the_new_expert(tiny_models, tmp_path):
    """A 2-expert MoE plus x3 with its prompt: text like the prompt goes to x3 more than other text does."""
    m = tiny_models("llama")
    two = merge(tmp_path, m, "two", "", experts=(1, 2))
    added = api.experts.add(two, m["e3"], tmp_path / "three", name="x3", prompts=[PROMPTS[3]]).output
    own, other = tmp_path / "own.txt", tmp_path / "other.txt"
    own.write_text("acute bronchitis; acute bronchitis due to virus\n" * 20)
    other.write_text("def main(): return 0\n" * 20)
    shares = api.experts.listing(added, {"own": str(own), "other": str(other)}, max_tokens=256)["routing"]["domains"]
    assert shares["own"]["share"][2] > shares["other"]["share"][2]


def test_an_edit_that_cannot_fit_is_refused_up_front(moe, tmp_path, monkeypatch):
    """With the check, the model is loaded: a budget below it refuses, naming --no-check; without it one tensor is held."""
    _m, merged = moe
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", "300MB")
    from moetool.io.budget import BudgetError

    with pytest.raises(BudgetError, match="experts remove needs about .* --no-check edits with one tensor in memory"):
        api.experts.remove(merged, ["x1"], tmp_path / "rm")
    assert not (tmp_path / "rm").exists()
    assert api.experts.remove(merged, ["x1"], tmp_path / "rm", verify=False).parity == {}
