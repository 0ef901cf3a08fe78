"""`moetool build`: one recipe → merge → exports for its targets → a repo folder."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from conftest import write_recipe
from moetool.cli import app
from moetool.recipe import load_recipe


def test_build_runs_the_recipe_pipeline(tiny_models, tmp_path):
    m = tiny_models("llama")
    (tmp_path / "t.txt").write_text("def main(): pass\n" * 50)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
name: built
method: mofe
base_model: {m["base"]}
gate_mode: random
experts: [{{name: a, source: {m["e1"]}}}, {{name: b, source: {m["e2"]}}}, {{name: c, source: {m["e3"]}}}]
quantization: {{preset: moe-q4}}
train: {{data: {{code: {{text: {tmp_path / "t.txt"}}}}}}}
targets:
  - for: raspberry-pi-4
  - {{target: onnx, quant: q8_0}}
  - for: iphone-13
""",
    )
    assert [t.dir_name for t in load_recipe(recipe).targets] == ["raspberry-pi-4", "onnx", "iphone-13"]
    r = CliRunner().invoke(app, ["build", str(recipe), "-o", str(tmp_path / "run"), "--no-train"])
    assert r.exit_code == 0, r.output
    run = tmp_path / "run"
    gg = json.loads((run / "exports" / "raspberry-pi-4" / "manifest.json").read_text())
    assert gg["target"] == "gguf" and gg["device"] == "raspberry-pi-4" and gg["plan"]["label"] == "moe-q4"
    onnx = json.loads((run / "exports" / "onnx" / "manifest.json").read_text())
    assert onnx["target"] == "onnx" and onnx["plan"]["label"] == "q8_0"
    assert (run / "hf-repo" / "gguf" / "raspberry-pi-4" / gg["file"]).is_file()
    # multi-file artifacts arrive whole: the ONNX graph with the files its runner reads, the Core ML package directory
    for name in ("model.onnx", "genai_config.json", "tokenizer.json"):
        assert (run / "hf-repo" / "onnx" / "onnx" / name).is_file()
    cm = json.loads((run / "exports" / "iphone-13" / "manifest.json").read_text())
    assert (
        cm["target"] == "coreml"
        and (run / "hf-repo" / "coreml" / "iphone-13" / "model.mlpackage" / "Manifest.json").is_file()
    )
    packaged = [f for f in (run / "hf-repo" / "coreml" / "iphone-13" / "model.mlpackage").rglob("*") if f.is_file()]
    assert len(packaged) == len(cm["files"])
    card = (run / "hf-repo" / "README.md").read_text()
    assert "Core ML runs on macOS only" in card
    assert "evaluation skipped" in r.output


def test_targets_section_errors(tiny_models, tmp_path):
    from moetool.errors import RecipeError

    m = tiny_models("llama")
    body = f"""name: t
method: mofe
base_model: {m["base"]}
gate_mode: random
experts_per_token: 1
experts: [{{name: a, source: {m["e1"]}}}]
targets:
  - {{for: toaster}}
"""
    r = CliRunner().invoke(app, ["validate", str(write_recipe(tmp_path / "r.yaml", body))])
    assert r.exit_code == 2 and "targets.0.for" in r.output and "unknown device 'toaster'" in r.output
    try:
        load_recipe(write_recipe(tmp_path / "r2.yaml", body.replace("{for: toaster}", "{quant: q4_0}")))
    except RecipeError as exc:
        assert "needs `for` (a deployment profile), a target, or both" in str(exc)
    else:
        raise AssertionError("a target without for or target must be refused")


def test_failed_optional_steps_end_the_build_with_their_reasons(monkeypatch):
    """A build whose task accuracy failed for a model still wrote everything else; it ends with exit status 1 and
    the reasons (api.build records them in BuildResult.failed)."""
    import pytest
    import typer
    from rich.console import Console

    from moetool.cli import build
    from moetool.cli.build import _report_failures

    log = Console(record=True, width=200)
    monkeypatch.setattr(build, "console", log)
    _report_failures([])  # nothing failed: returns
    with pytest.raises(typer.Exit) as exc:
        _report_failures(["task accuracy of out/merged: lm-eval could not run moetool_cont_legal: missing file"])
    assert exc.value.exit_code == 1
    text = " ".join(log.export_text().split())
    assert "1 optional step(s) failed; every other stage finished" in text and "moetool_cont_legal" in text


def test_the_build_printer_shows_a_methods_own_export_plan(capsys):
    """A method's exporter (GEM's targets) plans no quantization: the build's printer names it all the same."""
    from moetool.cli.build import _printer
    from moetool.methods.base import FunctionExporter, MethodExportPlan

    exporter = FunctionExporter("onnx", "onnx", "router graph and pathways", lambda req, console: {})
    _printer("export_plan", ("gem-onnx", exporter, MethodExportPlan("tiny-gem", "onnx", "router graph and pathways")))
    assert "onnx plan for tiny-gem: router graph and pathways" in capsys.readouterr().out
