"""An MoE of identical experts computes exactly what the dense model computes, whatever the router weights.

A Qwen2-MoE does with renormalised top-k weights (``norm_topk_prob: true``); its default is the un-normalised form
every consumer computes alike (arch.consumers), which weights the one expert by less than 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import write_recipe
from moetool.api import assemble


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(
    ("family", "arch", "expected_cls"),
    [
        ("llama", "mixtral", "MixtralForCausalLM"),
        ("qwen2", "qwen2_moe", "Qwen2MoeForCausalLM"),
        ("llama", "qwen2_moe", "Qwen2MoeForCausalLM"),
        ("qwen3", "qwen3_moe", "Qwen3MoeForCausalLM"),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_identical_experts_equal_dense(tiny_models, tmp_path, family, arch, expected_cls, seed):
    m = tiny_models(family)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
name: parity
method: mofe
base_model: {m["base"]}
architecture: {arch}
{"norm_topk_prob: true" if arch == "qwen2_moe" else ""}
experts_per_token: 2
gate_mode: random
seed: {seed}
experts:
  - {{name: a, source: {m["base"]}}}
  - {{name: b, source: {m["base"]}}}
  - {{name: c, source: {m["base"]}}}
""",
    )
    out = assemble(recipe, tmp_path / "moe")
    ids = torch.randint(4, 300, (2, 11), generator=torch.Generator().manual_seed(seed))
    moe = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(moe).__name__ == expected_cls
    delta = (_logits(out, ids) - _logits(m["base"], ids)).abs().max().item()
    assert delta <= 1e-5, f"{arch} from {family}: max |Δlogit| {delta}"


def test_distinct_experts_change_the_output(tiny_models, tmp_path):
    """Guards the parity test: different expert FFNs must give different logits."""
    m = tiny_models("llama")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
name: distinct
method: mofe
base_model: {m["base"]}
gate_mode: random
experts:
  - {{name: a, source: {m["e1"]}}}
  - {{name: b, source: {m["e2"]}}}
""",
    )
    out = assemble(recipe, tmp_path / "moe")
    ids = torch.randint(4, 300, (1, 9))
    assert (_logits(out, ids) - _logits(m["base"], ids)).abs().max().item() > 1e-3
