"""More MoE outputs: GraniteMoE from granite bases (its scales carried over), and the bases refused at plan time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import save_dense, write_recipe
from moetool.api import assemble, plan
from moetool.errors import PreflightError

# granite's four scales away from 1, so a merge that dropped one would show in the logits
GRANITE_SCALES = {
    "embedding_multiplier": 3.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.25,
    "logits_scaling": 2.5,
}


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("granite")
    base = save_dense(root / "base", "granite", **GRANITE_SCALES)
    return {"base": base, "e1": save_dense(root / "e1", "granite", seed=1, base=base, mlp_noise=0.3)}


def _recipe(tmp: Path, base: Path, experts: list[Path], seed: int = 0, extra: str = "") -> Path:
    lines = "\n".join(f"  - {{name: x{i}, source: {e}}}" for i, e in enumerate(experts))
    text = (
        f"name: more\nmethod: mofe\nbase_model: {base}\nexperts_per_token: 2\ngate_mode: random\nseed: {seed}\n"
        f"{extra}experts:\n{lines}\n"
    )
    return write_recipe(tmp / "r.yaml", text)


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("seed", [0, 1])
def test_granitemoe_of_identical_experts_equals_granite(granite, tmp_path, seed):
    out = assemble(_recipe(tmp_path, granite["base"], [granite["base"]] * 3, seed), tmp_path / "moe")
    _equal_to_dense(out, granite["base"], seed)


def test_granitemoe_with_attention_bias_and_tied_head(tmp_path):
    """Granite 3's tied embeddings and the attention_bias option carry over."""
    base = save_dense(tmp_path / "b", "granite", attention_bias=True, tie_word_embeddings=True, **GRANITE_SCALES)
    out = assemble(_recipe(tmp_path, base, [base] * 3), tmp_path / "moe")
    cfg = AutoConfig.from_pretrained(str(out))
    assert cfg.attention_bias and cfg.tie_word_embeddings
    _equal_to_dense(out, base, 0)


def _equal_to_dense(out: Path, base: Path, seed: int) -> None:
    cfg = AutoConfig.from_pretrained(str(out))
    assert type(cfg).__name__ == "GraniteMoeConfig" and cfg.num_local_experts == 3
    assert {k: getattr(cfg, k) for k in GRANITE_SCALES} == GRANITE_SCALES
    ids = torch.randint(4, 300, (2, 11), generator=torch.Generator().manual_seed(seed))
    delta = (_logits(out, ids) - _logits(base, ids)).abs().max().item()
    assert delta <= 1e-5, f"granitemoe from granite: max |Δlogit| {delta}"


def test_granitemoe_stacks_each_expert_gate_then_up(granite, tmp_path):
    """input_linear[e] = [gate; up] of expert e, output_linear[e] = its down: distinct experts land in place."""
    from safetensors.torch import load_file

    out = assemble(_recipe(tmp_path, granite["base"], [granite["base"], granite["e1"]]), tmp_path / "moe")
    moe = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    e1 = load_file(next(granite["e1"].glob("*.safetensors")))
    fused = moe["model.layers.1.block_sparse_moe.input_linear.weight"]
    assert fused.shape == (2, 96, 32)
    assert torch.equal(fused[1, :48], e1["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fused[1, 48:], e1["model.layers.1.mlp.up_proj.weight"])
    down = moe["model.layers.1.block_sparse_moe.output_linear.weight"]
    assert torch.equal(down[1], e1["model.layers.1.mlp.down_proj.weight"])
    assert moe["model.layers.0.block_sparse_moe.router.layer.weight"].shape == (2, 32)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GraniteMoeForCausalLM"]
    ids = torch.randint(4, 300, (1, 9))
    assert (_logits(out, ids) - _logits(granite["base"], ids)).abs().max().item() > 1e-3


def test_architecture_named_in_the_recipe(granite, tmp_path):
    """``architecture: granitemoe`` is accepted; Mixtral, which has no granite scales, refuses a granite base, and
    GraniteMoE has no norm_topk_prob switch (its router always renormalises the top-k)."""
    from moetool.errors import UnsupportedArchitecture

    base = granite["base"]
    planned = plan(_recipe(tmp_path, base, [base, base], extra="architecture: granitemoe\n"))
    assert planned.arch.name == "granitemoe"
    stacked = [op for op in planned.ops if op.kind == "stacked"]
    assert [(op.out.rsplit(".", 2)[-2], op.shape, op.origin) for op in stacked[:2]] == [
        ("input_linear", (2, 96, 32), "x0+x1"),
        ("output_linear", (2, 32, 48), "x0+x1"),
    ]
    with pytest.raises(UnsupportedArchitecture, match="mixtral accepts llama/mistral bases, not 'granite'"):
        plan(_recipe(tmp_path, base, [base, base], extra="architecture: mixtral\n"))
    with pytest.raises(PreflightError, match="norm_topk_prob: the granitemoe output has no such option"):
        plan(_recipe(tmp_path, base, [base, base], extra="norm_topk_prob: false\n"))


def test_expert_with_other_scales_is_refused(granite, tmp_path):
    other = save_dense(tmp_path / "other", "granite", **(GRANITE_SCALES | {"residual_multiplier": 0.4}))
    with pytest.raises(PreflightError, match="residual_multiplier is 0.4 but the base has 0.5"):
        plan(_recipe(tmp_path, granite["base"], [granite["base"], other]))


@pytest.mark.parametrize(
    ("family", "config_cls", "reason"),
    [
        ("olmo2", "Olmo2Config", "post-norm"),
        ("phi3", "Phi3Config", "sparsemixer"),
        ("gemma", "GemmaConfig", "GeGLU"),
    ],
)
def test_bases_without_an_exact_moe_are_refused_at_plan_time(tmp_path, family, config_cls, reason):
    import transformers

    cfg = getattr(transformers, config_cls)(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    base = tmp_path / family
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(base))
    with pytest.raises(
        PreflightError, match=rf"{family}.*supported: llama, mistral, qwen2, qwen3, granite\).*{reason}"
    ):
        plan(_recipe(tmp_path, base, [base, base]))


def test_granitemoe_router_tuning_trains_the_router_only(granite, tmp_path):
    """The routing tap and the freeze presets find GraniteMoE's block_sparse_moe.router; experts stay bitwise equal."""
    from safetensors.torch import load_file

    from conftest import TEXT
    from moetool.recipe import load_recipe
    from moetool.train.router_tuning import train_router

    (tmp_path / "t.txt").write_text(TEXT * 20)
    extra = (
        "freeze: {preset: router_only}\ntrain:\n  data: {all: {text: t.txt}}\n  steps: 2\n  batch_size: 2\n"
        "  seq_len: 16\n  learning_rate: 0.05\n"
    )
    recipe = _recipe(tmp_path, granite["base"], [granite["base"], granite["e1"]], extra=extra)
    src = assemble(recipe, tmp_path / "moe")
    res = train_router(load_recipe(recipe), src, tmp_path / "tuned")
    before = load_file(next(src.glob("*.safetensors")))
    after = load_file(next((tmp_path / "tuned").glob("*.safetensors")))
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {f"model.layers.{i}.block_sparse_moe.router.layer.weight" for i in (0, 1)}
    assert len(res.history[-1]["load"]) == 2
