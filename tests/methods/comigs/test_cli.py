"""CoMiGS from the command line: recipe errors, `moetool merge` (assembly), `moetool comigs train` and `bake`."""

from __future__ import annotations

import json

import pytest
import torch
from comigs_fixtures import RECIPE_YAML, tiny_base
from typer.testing import CliRunner

from conftest import TEXT
from moetool.cli import app
from moetool.errors import RecipeError
from moetool.recipe import load_recipe

torch.set_num_threads(1)

RECIPE = RECIPE_YAML.replace("{name}", "cli")


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("comigs-cli")
    base = tiny_base(root)
    lines = TEXT.strip().splitlines()
    (root / "a.txt").write_text("\n\n".join(lines[0] + " " + lines[1] for _ in range(40)))
    (root / "b.txt").write_text("\n\n".join(lines[2] + " " + lines[1] for _ in range(40)))
    path = root / "r.yaml"
    path.write_text(RECIPE.format(base=base))
    return path


def test_recipe_errors_name_field_and_line(tmp_path):
    bad = RECIPE.format(base="zoo:base").replace("{name: b1}", "{name: a1}").replace("rank: 4", "rank: 0")
    (tmp_path / "r.yaml").write_text(bad)
    with pytest.raises(RecipeError) as exc:
        load_recipe(tmp_path / "r.yaml")
    assert "r.yaml:4: lora.rank" in str(exc.value)
    (tmp_path / "r.yaml").write_text(RECIPE.format(base="zoo:base").replace("{name: b1}", "{name: a1}"))
    with pytest.raises(RecipeError, match=r"r.yaml:\d+: users.1.specialists.0.name: 'a1' is also users.0"):
        load_recipe(tmp_path / "r.yaml")


def test_merge_train_bake(recipe_file, tmp_path):
    run = CliRunner().invoke
    res = run(app, ["merge", str(recipe_file), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "user b: 3 experts (top-2)" in res.output and "upload" in res.output
    from moetool import api

    plan = api.plan(recipe_file)  # the same plan as data
    assert plan.method == "comigs" and set(plan.inputs) == {"base"}
    assert plan.parameters["expert LoRA"] > 0 and "user b: 3 experts (top-2)" in plan.render()

    res = run(app, ["merge", str(recipe_file), "-o", str(tmp_path / "init")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "init" / "comigs-assemble.json").read_text())
    assert all(u["max_abs_logit_diff_vs_base"] <= 1e-5 for u in report.values())  # fresh LoRA: B = 0
    res = run(app, ["merge", str(recipe_file), "-o", str(tmp_path / "init")])
    assert res.exit_code == 2 and "--force" in res.output

    res = run(app, ["comigs", "train", str(recipe_file), "-o", str(tmp_path / "tr"), "--variant", "nope"])
    assert res.exit_code == 2 and "--variant" in res.output
    res = run(app, ["comigs", "train", str(recipe_file), "-o", str(tmp_path / "tr")])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "tr" / "comigs-report.json").read_text())
    assert set(report["users"]) == {"a", "b"} and len(report["history"]) == 2
    assert all(u["reload_max_abs_logit_diff"] <= 1e-5 for u in report["users"].values())
    # the user's own text gets cheaper than before training
    assert all(u["test_ppl"] < u["test_ppl_before"] for u in report["users"].values())

    res = run(app, ["comigs", "bake", str(tmp_path / "tr" / "b"), "-o", str(tmp_path / "mix")])
    assert res.exit_code == 0, res.output
    bake = json.loads((tmp_path / "mix" / "comigs-bake.json").read_text())
    assert bake["parity_max_abs_logit_diff"] <= 1e-5 and bake["experts"] == ["generalist", "b1", "b2"]
    res = run(app, ["comigs", "bake", str(tmp_path / "init"), "-o", str(tmp_path / "mix2")])
    assert res.exit_code == 2 and "no config.json" in res.output


def test_build_runs_the_merge_then_the_federation(recipe_file, tmp_path):
    from moetool.api import build

    stages = []
    res = build(recipe_file, tmp_path / "run", on_stage=lambda name, value: stages.append(name))
    # CoMiGS trains after its merge, so build runs both; its output is one model per user, not one to package
    assert stages == ["merged", "trained"] and res.repo is None
    assert res.model == res.tuned["tuned"] == tmp_path / "run" / "tuned"
    assert {p.name for p in res.model.iterdir() if p.is_dir()} == {"a", "b"}
    report = json.loads((res.model / "comigs-report.json").read_text())
    assert set(report["users"]) == {"a", "b"}
