"""Planning a standard export: the recipe's objects passed down (no disk read back) and target options in the plan."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moetool.errors import RecipeError
from moetool.export import ExportError
from moetool.export.resolve import plan_standard_export
from moetool.recipe.kept import KEPT_RECIPE, write_kept_recipe
from moetool.recipe.load import parse_recipe

RECIPE = (
    "name: t\nmethod: mofe\nbase_model: zoo:base\ngate_mode: random\n"
    "experts: [{{name: a, source: zoo:code}}, {{name: b, source: zoo:legal}}]\n"
    "quantization: {{preset: {preset}}}\n"
)


@pytest.fixture
def model(tiny_models, tmp_path) -> Path:
    """A copy of a tiny model whose folder keeps a recipe asking for q8_0."""
    out = Path(shutil.copytree(tiny_models("llama")["base"], tmp_path / "model"))
    write_kept_recipe(out, parse_recipe(RECIPE.format(preset="q8_0"), tmp_path / "r.yaml"))
    return out


def test_the_folders_recipe_gives_the_plan(model, tmp_path):
    job = plan_standard_export(model, tmp_path / "o", target="gguf")
    assert job.plan.quant.label == "q8_0"


def test_a_recipe_passed_down_is_used_and_the_folder_is_not_read(model, tmp_path):
    (model / KEPT_RECIPE).write_text("quantization: [\n")  # never read when the recipe is given
    recipe = parse_recipe(RECIPE.format(preset="f32"), tmp_path / "r.yaml")
    job = plan_standard_export(model, tmp_path / "o", target="gguf", recipe=recipe)
    assert job.plan.quant.label == "f32"
    with pytest.raises(RecipeError, match=rf"{KEPT_RECIPE}:2:.*not valid YAML"):
        plan_standard_export(model, tmp_path / "o", target="gguf")


def test_target_options_are_planned_not_set_afterwards(model, tmp_path):
    job = plan_standard_export(model, tmp_path / "o", target="onnx", quant="f32", moe_kernel="dense")
    assert job.request.options == {"moe_kernel": "dense"} and job.plan.options == {"moe_kernel": "dense"}
    with pytest.raises(ExportError, match="--compute-units ALL: only the coreml target reads it, not gguf"):
        plan_standard_export(model, tmp_path / "o", target="gguf", compute_units="ALL")


@pytest.mark.parametrize(
    ("option", "flag"),
    [("moe_kernel", "--moe-kernel"), ("compute_units", "--compute-units"), ("accuracy_level", "--accuracy-level")],
)
def test_a_methods_output_refuses_target_options_at_planning(tmp_path, option, flag):
    from moetool.api import plan_export

    bundle = tmp_path / "hybrid"
    bundle.mkdir()
    (bundle / "hybrid.json").write_text("{}")  # the hybrid bundle's marker: its own exporter, its own format
    with pytest.raises(ExportError, match=f"is a hybrid model: {flag} applies to standard MoE models"):
        plan_export(bundle, tmp_path / "o", **{option: "x"})
