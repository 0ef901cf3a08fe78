"""The plugin registry: one entry per method, lazy loading, Auto-class registration, and `moetool export` serving
every method's output (or refusing with the targets it supports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moetool import registry
from moetool.export import ExportError


def test_cli_starts_without_loading_methods() -> None:
    code = "import sys, moetool.cli; print(any(m.startswith('moetool.methods.') for m in sys.modules), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"], "moetool --help must not import the method packages or torch"


def test_every_registered_method_has_a_plugin_and_a_recipe() -> None:
    from moetool.methods import get_plugin
    from moetool.recipe.load import recipe_models

    models = recipe_models()
    for method in registry.METHODS:
        assert get_plugin(method).name == method
        assert models[method].model_fields["method"].annotation.__args__ == (method,)  # type: ignore[union-attr]


def test_unknown_names_get_did_you_mean(tmp_path: Path) -> None:
    from moetool.errors import MoetoolError
    from moetool.export import get_exporter
    from moetool.methods import get_plugin
    from moetool.recipe.load import parse_recipe

    with pytest.raises(MoetoolError, match="did you mean 'gem'"):
        get_plugin("gen")
    with pytest.raises(ExportError, match="did you mean 'onnx'"):
        get_exporter("onxx")
    with pytest.raises(MoetoolError, match="r.yaml:2: method: 'mofee' is not a known method \\(did you mean 'mofe'"):
        parse_recipe("name: x\nmethod: mofee\n", tmp_path / "r.yaml")


def test_models_module_registers_auto_classes() -> None:
    from transformers import AutoConfig

    import moetool.models  # noqa: F401

    for model_type in ("moetool_comigs", "moetool_gem", "moetool_routed_embedding"):
        assert AutoConfig.for_model(model_type).model_type == model_type


@pytest.mark.parametrize(
    ("files", "target", "exporter", "refusal"),
    [
        ({"config.json": {"model_type": "moetool_gem"}}, None, "onnx", "supported: onnx, tflite"),
        ({"gem.json": {}}, None, "gguf", "supported: onnx, tflite, gguf"),
        ({"config.json": {"model_type": "moetool_routed_embedding"}}, None, "onnx", "supported: onnx, tflite, coreml"),
        ({"config.json": {"model_type": "moetool_comigs"}}, "onnx", "onnx", "supported: gguf, onnx"),
        ({"hybrid.json": {}}, None, "gguf", "supported: gguf, onnx"),
    ],
)
def test_export_serves_every_method(
    tmp_path: Path, files: dict[str, dict], target: str | None, exporter: str, refusal: str
) -> None:
    from moetool.api import plan_export

    model = tmp_path / "model"
    model.mkdir()
    for name, data in files.items():
        (model / name).write_text(json.dumps(data))
    chosen, _, plan = plan_export(model, tmp_path / "out", target=target)
    assert chosen.name == exporter and plan.description
    with pytest.raises(ExportError, match=refusal):
        plan_export(model, tmp_path / "out", target="nonsense")


def test_a_method_exporter_runs_its_function_for_the_chosen_target(tmp_path: Path) -> None:
    from moetool.export.base import ExportRequest
    from moetool.methods.embedding import PLUGIN
    from moetool.quant.plan import QuantSpec

    exporter = PLUGIN.exporter(tmp_path, "tflite")
    req = ExportRequest(tmp_path, tmp_path / "out", QuantSpec(), options={"quant": "q8_0"})
    with pytest.raises(ExportError, match=r"--quant: routed-embedding models export in float32 only \(tflite\)"):
        exporter.export(req, exporter.plan(req))
