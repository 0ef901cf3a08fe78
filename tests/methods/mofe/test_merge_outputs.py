"""What a merge writes: a checkpoint transformers loads and generates with, names llama.cpp maps, a model card."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import write_recipe
from moetool.api import assemble, plan
from moetool.inspect import inspect_model
from moetool.io.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def merged(tiny_models, tmp_path_factory):
    m = tiny_models("llama")
    d = tmp_path_factory.mktemp("merged")
    recipe = write_recipe(
        d / "r.yaml",
        f"""
name: three-experts
method: mofe
base_model: {m["base"]}
experts_per_token: 2
gate_mode: hidden
max_shard_size: 40000
experts:
  - {{name: code, source: {m["e1"]}, positive_prompts: ["def main():"]}}
  - {{name: legal, source: {m["e2"]}, positive_prompts: ["Permission is hereby granted"]}}
  - {{name: medical, source: {m["e3"]}, positive_prompts: ["acute bronchitis"]}}
""",
    )
    return m, assemble(recipe, d / "moe")


def test_loads_and_generates(merged):
    _, out = merged
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert type(model).__name__ == "MixtralForCausalLM"
    ids = tok("def main():", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 5


def test_expert_ffns_come_from_the_experts(merged):
    m, out = merged
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "max_shard_size should have forced several shards"
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    with safe_open(str(out / index["weight_map"][name]), "pt") as f:
        got = f.get_tensor(name)
    with safe_open(str(m["e3"] / "model.safetensors"), "pt") as f:
        want = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    assert torch.equal(got, want)
    with safe_open(str(m["base"] / "model.safetensors"), "pt") as f:
        attn = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(out / index["weight_map"][name]), "pt") as f:
        assert torch.equal(f.get_tensor(name), attn)
    # legacy per-expert names only: llama.cpp's converter cannot map the fused layout
    assert not any("gate_up_proj" in k for k in index["weight_map"])


def test_model_card_and_provenance(merged):
    m, out = merged
    card = ModelCard.load(str(out / "README.md"))
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert {"moe", "moetool"} <= set(data["tags"])
    # local sources have no Hub id: they are not claimed as base_model (the Hub would reject them)
    assert "base_model" not in data and "base_model_relation" not in data
    assert str(m["e3"]) in card.text
    meta = json.loads((out / "moetool.json").read_text())
    assert meta["experts"] == ["code", "legal", "medical"]
    files = meta["provenance"]["sources"]["code"]["files"]
    assert list(files) == ["model.safetensors"] and len(files["model.safetensors"]) == 64
    assert yaml.safe_load((out / "moetool-recipe.yaml").read_text())["name"] == "three-experts"


def test_inspect(merged):
    _m, out = merged
    info = inspect_model(out)
    assert info["architecture"] == "MixtralForCausalLM"
    assert info["num_experts"] == 3 and info["experts_per_token"] == 2
    assert info["expert_names"] == ["code", "legal", "medical"]
    assert info["router_shapes"] == {"0": [3, 32], "1": [3, 32]}
    model = AutoModelForCausalLM.from_pretrained(str(out))
    total = sum(p.numel() for p in model.parameters())
    assert info["total_params"] == total
    per_expert = 3 * 32 * 48
    assert info["active_params_per_token"] == total - 2 * per_expert  # one idle expert per layer, 2 layers


def test_dry_run_plan_reads_no_weights(merged, tmp_path):
    m, _ = merged
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
name: dry
method: mofe
base_model: {m["base"]}
gate_mode: random
experts:
  - {{name: a, source: {m["e1"]}}}
  - {{name: b, source: {m["e2"]}}}
  - {{name: c, source: {m["e3"]}}}
""",
    )
    merge_plan = plan(recipe)
    kinds = {op.kind for op in merge_plan.ops}
    assert kinds == {"copy", "expert", "router"}
    assert merge_plan.total_bytes == sum(op.numel for op in merge_plan.ops) * 4
    assert any("not a power of two" in w for w in merge_plan.warnings)
    assert not (tmp_path / "moe").exists()


def test_peak_memory_estimate(tiny_models, tmp_path):
    m = tiny_models("llama")
    text = f"name: mem\nmethod: mofe\nbase_model: {m['base']}\ngate_mode: {{mode}}\nexperts:\n" + "".join(
        f"  - {{{{name: e{i}, source: {m[f'e{i}']}, positive_prompts: [x]}}}}\n" for i in (1, 2)
    )
    random_plan = plan(write_recipe(tmp_path / "a.yaml", text.format(mode="random")))
    largest = max(op.numel for op in random_plan.ops) * 4
    assert random_plan.peak_memory_estimate() == 2 * largest  # streaming: one tensor at a time, not a shard
    hidden_plan = plan(write_recipe(tmp_path / "b.yaml", text.format(mode="hidden")))
    dense_params = sum(t.numel for t in Checkpoint(m["base"]).tensors.values())
    assert hidden_plan.peak_memory_estimate() == dense_params * 4  # the base model, freed before streaming
