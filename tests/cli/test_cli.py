"""The command line: exit codes, messages, and that each command does what it says."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from conftest import write_recipe
from moetool.cli import app

runner = CliRunner()


def _recipe(tmp_path, m, extra=""):
    return write_recipe(
        tmp_path / "r.yaml",
        f"""
name: cli
method: mofe
base_model: {m["base"]}
gate_mode: random
{extra}experts:
  - {{name: a, source: {m["e1"]}}}
  - {{name: b, source: {m["e2"]}}}
""",
    )


def test_validate_ok_and_bad(tmp_path, tiny_models):
    r = _recipe(tmp_path, tiny_models("llama"))
    res = runner.invoke(app, ["validate", str(r)])
    assert res.exit_code == 0 and "ok" in res.output
    bad = write_recipe(tmp_path / "bad.yaml", r.read_text().replace("gate_mode", "gate_mod"))
    res = runner.invoke(app, ["validate", str(bad)])
    assert res.exit_code == 2
    assert "bad.yaml:5: gate_mod: unknown key" in res.output
    shapes = write_recipe(tmp_path / "s.yaml", r.read_text().replace("gate_mode: random", "experts_per_token: 5"))
    res = runner.invoke(app, ["validate", str(shapes)])
    assert "experts_per_token: 5 is larger than the number of experts (2)" in res.output


def test_schema_is_json():
    res = runner.invoke(app, ["schema"])
    assert res.exit_code == 0
    assert "MoFERecipe" in json.loads(res.stdout)["$defs"]


def test_merge_dry_run_writes_nothing(tmp_path, tiny_models, monkeypatch):
    # output that is not a terminal is never hard-wrapped: long tensor names arrive whole
    r = _recipe(tmp_path, tiny_models("llama"))
    res = runner.invoke(app, ["merge", str(r), "--output", str(tmp_path / "o"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "block_sparse_moe.experts.1.w3.weight" in res.output
    assert "peak memory estimate" in res.output
    assert not (tmp_path / "o").exists()


def test_merge_then_inspect_json(tmp_path, tiny_models):
    r = _recipe(tmp_path, tiny_models("llama"), extra="experts_per_token: 1\n")
    res = runner.invoke(app, ["merge", str(r), "--output", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["merge", str(r), "--output", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--force" in res.output
    res = runner.invoke(app, ["inspect", str(tmp_path / "o"), "--json"])
    info = json.loads(res.stdout)
    assert info["num_experts"] == 2 and info["experts_per_token"] == 1 and info["expert_names"] == ["a", "b"]


def test_export_dry_run_prints_the_exports_own_need_and_whether_it_fits(tmp_path, tiny_models, monkeypatch):
    """--dry-run writes nothing and says what the export itself needs of this machine (beyond the device's
    figure), and that it would be refused under a budget it does not fit."""
    base = tiny_models("llama")["base"]
    args = ["export", str(base), "-o", str(tmp_path / "o"), "--target", "tflite", "--quant", "q8_0", "--dry-run"]
    res = CliRunner().invoke(app, [*args, "--chunk-layers", "1", "--jobs", "2"])
    assert res.exit_code == 0, res.output
    assert "the export needs about" in res.output and "2 at once" in res.output
    assert "would be refused" not in res.output
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", "1M")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "it would be refused: tflite export needs about" in " ".join(res.output.split())
    assert not (tmp_path / "o").exists()
