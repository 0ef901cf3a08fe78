"""The proofs of `moetool experts` on moetool-built MoEs of every output architecture (tiny models from configs):
add then remove gives back the input bit for bit, extract gives back the source expert bit for bit, remove keeps
every other tensor, and every output loads in plain transformers and passes its own parity check."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch

from conftest import write_recipe
from moetool import api
from moetool.arch.released import released_config
from moetool.edit.layout import read_layout
from moetool.io.checkpoint import Checkpoint

SHARED = "shared_expert: {{source: {base}, positive_prompts: ['def']}}\nnorm_topk_prob: false\n"
# name: (dense family, recipe lines)
CASES = {
    "mixtral": ("llama", ""),
    "qwen2_moe-shared": ("qwen2", SHARED),
    "qwen2_moe-no-shared": ("qwen2", "norm_topk_prob: false\n"),
    "qwen2_moe-from-llama": ("llama", "architecture: qwen2_moe\n"),
    "qwen3_moe": ("qwen3", ""),
    "granitemoe": ("granite", ""),
}
PROMPTS = {1: "def main():", 2: "Permission is hereby granted", 3: "acute bronchitis"}


def merge(tmp: Path, m: dict[str, Path], name: str, extra: str, experts: tuple[int, ...] = (1, 2, 3)) -> Path:
    lines = "".join(f"  - {{name: x{i}, source: {m[f'e{i}']}, positive_prompts: ['{PROMPTS[i]}']}}\n" for i in experts)
    text = f"name: {name}\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\n{extra}experts:\n{lines}"
    return api.assemble(write_recipe(tmp / f"{name}.yaml", text), tmp / name)


def tensors_equal(a: Path, b: Path) -> None:
    ca, cb = Checkpoint(a), Checkpoint(b)
    assert list(ca.tensors) == list(cb.tensors) or set(ca.tensors) == set(cb.tensors)
    for name in ca.tensors:
        x, y = ca.get(name), cb.get(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tiny_models, tmp_path_factory) -> tuple[str, dict[str, Path], Path]:
    family, extra = CASES[request.param]
    m = tiny_models(family)
    tmp = tmp_path_factory.mktemp(request.param)
    return request.param, m, merge(tmp, m, "moe", extra.format(base=m["base"]))


def test_add_then_remove_is_the_input_bit_for_bit(built, tmp_path):
    _case, m, moe = built
    small = api.experts.remove(moe, ["x3"], tmp_path / "small").output
    added = api.experts.add(small, m["e3"], tmp_path / "added", name="x3", prompts=[PROMPTS[3]])
    assert added.parity["old_experts_vs_input"] <= 1e-5  # nothing but the new expert moved (0 but for granite)
    assert added.parity["new_expert_vs_source"] < 1e-4  # routed alone, it is the source model
    assert read_layout(added.output).names == ("x1", "x2", "x3")
    back = api.experts.remove(added.output, ["x3"], tmp_path / "back").output
    tensors_equal(back, small)
    assert json.loads((back / "config.json").read_text()) == json.loads((small / "config.json").read_text())
    for f in small.iterdir():  # the weights file included: same order, same header, same bytes
        if f.name not in ("moetool.json", "README.md"):
            assert filecmp.cmp(f, back / f.name, shallow=False), f.name
    edits = json.loads((back / "moetool.json").read_text())["edits"]
    assert [e["op"] for e in edits] == ["remove", "add", "remove"]
    assert "## Edits" in (back / "README.md").read_text()


def test_extract_gives_back_the_source_expert(built, tmp_path):
    case, m, moe = built
    result = api.experts.extract(moe, "x2", tmp_path / "x2")
    tensors_equal(result.output, m["e2"])
    # the source's config in the form the family's releases use (top-level rope_theta: arch.released)
    source = released_config(json.loads((m["e2"] / "config.json").read_text()))
    assert json.loads((result.output / "config.json").read_text()) == source
    assert result.parity["vs_input_one_expert"] < 1e-4
    if case == "qwen2_moe-shared":
        assert any("shared expert" in w for w in result.plan.warnings)
        shared = api.experts.extract(moe, "shared", tmp_path / "shared").output
        tensors_equal(shared, m["base"])  # the recipe's shared expert is the base


def test_remove_keeps_every_other_tensor_and_loads(built, tmp_path):
    from transformers import AutoModelForCausalLM

    _case, _m, moe = built
    result = api.experts.remove(moe, ["1"], tmp_path / "rm")  # an index works as well as a name
    assert result.parity["vs_input_restricted"] <= 1e-5
    layout = read_layout(result.output)
    assert layout.names == ("x1", "x3") and layout.n_experts == 2
    src, out = Checkpoint(moe), Checkpoint(result.output)
    before = read_layout(moe)
    for name in out.tensors:
        if any(name in before.expert_names(layer) for layer in before.moe_layers) or "experts" in name:
            continue
        assert torch.equal(out.get(name), src.get(name)), name
    model = AutoModelForCausalLM.from_pretrained(str(result.output))
    assert type(model).__name__ == before.arch.class_name


def test_renormalised_shares_after_removal_sum_to_one(built, tmp_path):
    _case, _m, moe = built
    out = api.experts.remove(moe, ["x2"], tmp_path / "rm").output
    text = tmp_path / "mix.txt"
    text.write_text("def f(x): return x\nPermission is hereby granted.\nAcute bronchitis.\n" * 20)
    report = api.experts.listing(out, {"mix": str(text)}, max_tokens=256)
    for layer in report["routing"]["layers"].values():
        assert sum(layer["share"]) == pytest.approx(1.0)
