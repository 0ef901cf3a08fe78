"""Qwen2-MoE with a shared expert: weights land where they should and the output is exactly what the math says."""

from __future__ import annotations

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import write_recipe
from moetool.api import assemble


def test_shared_expert_exact(tiny_models, tmp_path):
    m = tiny_models("qwen2")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
name: shared
method: mofe
base_model: {m["base"]}
gate_mode: random
experts:
  - {{name: a, source: {m["base"]}}}
  - {{name: b, source: {m["base"]}}}
shared_expert:
  source: {m["base"]}
""",
    )
    out = assemble(recipe, tmp_path / "moe")
    moe = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(moe).__name__ == "Qwen2MoeForCausalLM" and moe.config.shared_expert_intermediate_size == 48
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert torch.count_nonzero(f.get_tensor("model.layers.0.mlp.shared_expert_gate.weight")) == 0
    # routed experts (weights sum to 1) give base_mlp(x); the shared one adds sigmoid(0) * base_mlp(x)
    dense = AutoModelForCausalLM.from_pretrained(str(m["base"]), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in dense.model.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
        ids = torch.randint(4, 300, (2, 9))
        delta = (moe(ids).logits - dense(ids).logits).abs().max().item()
    assert delta <= 1e-5, delta


def test_shared_expert_gate_from_prompts(tiny_models, tmp_path):
    m = tiny_models("qwen2")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
name: shared-prompts
method: mofe
base_model: {m["base"]}
gate_mode: hidden
experts:
  - {{name: a, source: {m["e1"]}, positive_prompts: ["def main():"]}}
  - {{name: b, source: {m["e2"]}, positive_prompts: ["acute bronchitis"]}}
shared_expert:
  source: {m["e3"]}
  positive_prompts: ["Permission is hereby granted"]
""",
    )
    out = assemble(recipe, tmp_path / "moe")
    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(m["e3"] / "model.safetensors"), "pt") as g:
        gate = f.get_tensor("model.layers.1.mlp.shared_expert_gate.weight")
        assert gate.shape == (1, 32) and abs(gate.norm().item() - 1) < 1e-5
        assert torch.equal(
            f.get_tensor("model.layers.1.mlp.shared_expert.up_proj.weight"),
            g.get_tensor("model.layers.1.mlp.up_proj.weight"),
        )
