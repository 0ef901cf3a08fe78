"""``moetool export --target mlx``: an mlx-lm folder with the plan's precision per module, written by mlx-lm's own
loader and quantizer and checked in mlx-lm against transformers float32."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core  # noqa: F401  (the dev extra installs mlx-lm; a missing runtime must fail, not skip)
import pytest
from consumer_fixtures import merge

from conftest import save_dense
from moetool.api import export, plan_export
from moetool.arch.outputs import OUTPUT_ARCHS
from moetool.export import ExportError
from moetool.export.base import ExportRequest, get_exporter
from moetool.export.mlx.names import mlx_precision, module_paths
from moetool.io.safe import read_json
from moetool.quant.plan import QuantSpec, parse_quant

SHARED = "shared_expert: {{source: {base}, positive_prompts: ['def']}}\n"
WIDE = {"hidden_size": 64, "intermediate_size": 128}  # rows a group of 64 divides, so every matrix quantizes


def _wide(tmp: Path, family: str = "llama") -> dict[str, Path]:
    base = save_dense(tmp / "base", family, **WIDE)
    return {"base": base} | {
        f"e{i}": save_dense(tmp / f"e{i}", family, seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)
    }


@pytest.mark.parametrize(
    ("family", "case", "extra"),
    [("llama", "mixtral", ""), ("qwen2", "qwen2_moe-shared", SHARED), ("qwen3", "qwen3_moe", ""), ("granite", "granitemoe", "")],
)  # fmt: skip
def test_f32_folder_equals_transformers_in_mlx_lm(family, case, extra, tiny_models, tmp_path):
    moe = merge(tmp_path, tiny_models(family), case, extra)
    man = export(moe, tmp_path / "out", target="mlx", quant="f32")
    parity = man["parity"]
    assert max(parity["max_abs_logit_diff"].values()) <= 1e-4 and parity["decode"]["max_abs_logit_diff"] <= 1e-4
    assert parity["seq_lens"] == [32, 128] and parity["top1_agreement"] == 1.0 and parity["tokenizer_match"]
    out = tmp_path / "out"
    assert {"model.safetensors", "config.json", "tokenizer.json", "manifest.json"} <= {p.name for p in out.iterdir()}
    cfg = read_json(out / "config.json")
    assert "quantization" not in cfg and cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert man["target"] == "mlx" and man["moe_kernel"]["kind"] == "sparse" and man["runtime"].startswith("mlx-lm")


def test_moe_q4_quantizes_experts_4_bit_and_keeps_the_router(tmp_path):
    moe = merge(tmp_path, _wide(tmp_path), "mixtral")
    man = export(moe, tmp_path / "out", target="mlx")  # the default plan: moe-q4
    q = read_json(tmp_path / "out" / "config.json")["quantization"]
    switch = q["model.layers.0.block_sparse_moe.switch_mlp.gate_proj"]
    assert (switch["bits"], switch["group_size"]) == (4, 64)
    assert q["model.layers.0.self_attn.q_proj"]["bits"] == 8 and q["model.embed_tokens"]["bits"] == 8
    assert "model.layers.0.block_sparse_moe.gate" not in q  # the router stays float: no scales written
    assert man["plan"]["label"] == "moe-q4" and man["plan"]["mlx_precisions"]["4-bit"] == 2 * 3
    f32 = export(moe, tmp_path / "f32", target="mlx", quant="f32")
    assert man["artifact"]["bytes"] < 0.45 * f32["artifact"]["bytes"]
    p = man["parity"]  # figures of a tiny random model at 4 bits: reported; the weights are what is proven
    assert p["weights"] == {"modules": 2 * 3 + 2 * 4 + 2, "identical": 16, "differing": []}
    assert 0 < p["top1_agreement"] <= 1 and p["tokens_scored"] > 0


@pytest.mark.parametrize(("family", "case"), [("llama", "mixtral"), ("granite", "granitemoe"), ("qwen2", "qwen2_moe")])
def test_the_weight_check_catches_two_experts_swapped(family, case, tmp_path):
    """The rounding check reads the experts from the source safetensors by index, not through mlx-lm's loader."""
    import mlx.core as mx

    from moetool.export.mlx.runtime import rounding

    moe = merge(tmp_path, _wide(tmp_path, family), case)
    exporter = get_exporter("mlx")
    req = ExportRequest(model_dir=moe, output=tmp_path / "out", quant=parse_quant("moe-q4"), verify=False)
    plan = exporter.plan(req)
    exporter.export(req, plan)
    path = next(p for p in plan.module_paths() if "layers.1." in p and p.endswith("switch_mlp.up_proj"))
    assert rounding(tmp_path / "out", moe, plan.module_paths()).differing == ()
    file = tmp_path / "out" / "model.safetensors"
    w = dict(mx.load(str(file)))
    for k in ("weight", "scales", "biases"):
        t = w[f"{path}.{k}"]
        w[f"{path}.{k}"] = mx.concatenate([t[1:2], t[0:1], t[2:]])
    mx.save_safetensors(str(file), w, metadata={"format": "mlx"})
    assert rounding(tmp_path / "out", moe, plan.module_paths()).differing == (path,)


def test_a_plan_that_splits_a_layers_experts_is_refused_before_writing(tmp_path):
    moe = merge(tmp_path, _wide(tmp_path), "mixtral")
    spec = parse_quant("*.experts.0.*=q8_0,experts=q4_0,*=q8_0")
    req = ExportRequest(model_dir=moe, output=tmp_path / "out", quant=spec)
    with pytest.raises(ExportError, match=r"switch_mlp\.\w+_proj holds 3 tensors .* 4-bit, 8-bit"):
        get_exporter("mlx").plan(req)
    assert not (tmp_path / "out").exists()


def test_names_map_to_mlx_lm_modules():
    granite = OUTPUT_ARCHS["granitemoe"]
    paths = module_paths(granite, ["model.layers.1.block_sparse_moe.input_linear.weight", "model.norm.weight"])
    assert paths == {
        "model.layers.1.block_sparse_moe.switch_mlp.gate_proj": ["model.layers.1.block_sparse_moe.input_linear.weight"],
        "model.layers.1.block_sparse_moe.switch_mlp.up_proj": ["model.layers.1.block_sparse_moe.input_linear.weight"],
        "model.norm": ["model.norm.weight"],
    }
    qwen = module_paths(OUTPUT_ARCHS["qwen3_moe"], ["model.layers.0.mlp.experts.2.down_proj.weight"])
    assert list(qwen) == ["model.layers.0.mlp.switch_mlp.down_proj"]
    assert [mlx_precision(t) for t in ("q8_0", "q4_k", "q6_k", "iq2_xs", "bf16")] == [
        "8-bit", "4-bit", "6-bit", "2-bit", "bf16",
    ]  # fmt: skip


def test_an_older_folder_without_rope_theta_still_gets_its_rope(tmp_path, tiny_models):
    """A folder merged before the released keys (no top-level rope_theta): mlx-lm would default it to 1e6."""
    moe = merge(tmp_path, tiny_models("llama"), "mixtral")
    cfg = json.loads((moe / "config.json").read_text())
    del cfg["rope_theta"]
    (moe / "config.json").write_text(json.dumps(cfg))
    man = export(moe, tmp_path / "out", target="mlx", quant="f32")
    assert max(man["parity"]["max_abs_logit_diff"].values()) <= 1e-4
    assert read_json(tmp_path / "out" / "config.json")["rope_theta"] == cfg["rope_parameters"]["rope_theta"]


def test_the_mac_profile_picks_an_mlx_plan(tmp_path, tiny_models):
    moe = merge(tmp_path, tiny_models("llama"), "mixtral")
    req = ExportRequest(model_dir=moe, output=tmp_path / "out", quant=QuantSpec(), device="mac-16gb")
    plan = get_exporter("mlx").plan(req)
    assert plan.device == "mac-16gb" and plan.quant.label == "f16"  # the ladder's first, far within 10.6 GB


def test_every_registered_target_is_a_recipe_target():
    """``targets: [{target: mlx}]`` in a recipe is accepted for every exporter the registry has."""
    from typing import get_args

    from moetool.recipe.export import Target
    from moetool.registry import TARGETS

    assert set(get_args(Target)) == set(TARGETS)


def test_a_qwen2_moe_that_renormalises_its_top_k_is_refused_before_any_work(tmp_path):
    """mlx-lm's Qwen2-MoE never renormalises the top-k weights: with `norm_topk_prob: true` the folder computes
    another function, which the f32 gate would only report after writing and loading it."""
    moe = merge(tmp_path, _wide(tmp_path, "qwen2"), "qwen2_moe", "norm_topk_prob: true\n")
    req = ExportRequest(model_dir=moe, output=tmp_path / "out", quant=parse_quant("f32"))
    with pytest.raises(ExportError, match=r"norm_topk_prob: true, but mlx-lm .* never renormalises .*"
                       r"`norm_topk_prob: false` in the recipe"):  # fmt: skip
        get_exporter("mlx").plan(req)
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_mlx_exports_need_and_a_run_that_does_not_fit_is_refused_up_front(
    tmp_path, tiny_models, monkeypatch
):
    from typer.testing import CliRunner

    from moetool.cli import app
    from moetool.io.budget import BudgetError

    moe = merge(tmp_path, tiny_models("llama"), "mixtral")
    args = ["export", str(moe), "-o", str(tmp_path / "out"), "--target", "mlx", "--dry-run"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "the export needs about" in res.output and "written by mlx-lm" in res.output
    assert "would be refused" not in res.output and not (tmp_path / "out").exists()
    job = plan_export(moe, tmp_path / "out", target="mlx", quant="f32")
    assert job.need().disk == job.plan.quant.total_bytes  # the artifact: the float32 weights
    assert job.need().memory > plan_export(moe, tmp_path / "out", target="mlx", verify=False).need().memory
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", "1M")
    assert "would be refused" in CliRunner().invoke(app, args).output
    with pytest.raises(BudgetError, match=r"MLX export \(moe-q4\) needs about .* nothing was written"):
        export(moe, tmp_path / "out", target="mlx")
    assert not (tmp_path / "out").exists()
