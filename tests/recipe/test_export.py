"""``targets:`` entries: ``for:`` names the deployment profile; ``device:``, its old spelling, is read with a warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from moetool.errors import MoetoolDeprecationWarning, RecipeError
from moetool.recipe import load_recipe
from moetool.recipe.load import parse_recipe, recipe_json_schema

ROOT = Path(__file__).resolve().parents[2]
MOFE = """\
name: t
method: mofe
base_model: zoo:base
gate_mode: random
experts: [{name: code, source: zoo:code}, {name: legal, source: zoo:legal}]
targets:
"""


def test_for_names_the_profile_and_sets_the_folder():
    r = parse_recipe(MOFE + "  - for: raspberry-pi-4\n  - {for: laptop, target: onnx}\n", Path("r.yaml"))
    assert [t.for_ for t in r.targets] == ["raspberry-pi-4", "laptop"]
    assert [t.dir_name for t in r.targets] == ["raspberry-pi-4", "laptop-onnx"]
    assert yaml.safe_load(r.targets[1].model_dump_json(exclude_none=True)) == {"for": "laptop", "target": "onnx"}


def test_the_old_device_key_is_read_with_a_warning_naming_for():
    with pytest.warns(
        MoetoolDeprecationWarning, match=r"targets: `device: iphone-13` is the old spelling; write `for:"
    ):
        r = parse_recipe(MOFE + "  - device: iphone-13\n", Path("r.yaml"))
    assert r.targets[0].for_ == "iphone-13" and r.targets[0].dir_name == "iphone-13"


def test_both_spellings_are_refused_by_field():
    with pytest.raises(RecipeError, match=r"targets\.0\.device: the old spelling of `for`, which is also given"):
        parse_recipe(MOFE + "  - {device: pixel-6, for: pixel-6}\n", Path("r.yaml"))


def test_an_unknown_profile_is_named_under_for():
    with pytest.raises(RecipeError, match=r"r.yaml:7: targets\.0\.for: unknown device 'toaster'"):
        parse_recipe(MOFE + "  - for: toaster\n", Path("r.yaml"))


def test_the_hybrid_profiles_device_key_is_read_as_for():
    text = (ROOT / "recipes" / "demo-hybrid.yaml").read_text()
    assert "  for: this-machine\n" in text
    with pytest.warns(
        MoetoolDeprecationWarning, match=r"profile: `device: pi-5` is the old spelling; write `for: pi-5`"
    ):
        r = parse_recipe(text.replace("  for: this-machine\n", "  device: pi-5\n"), ROOT / "recipes" / "h.yaml")
    assert r.profile.for_ == "pi-5"


def test_the_schema_names_for_not_device():
    props = recipe_json_schema()["$defs"]["TargetSpec"]["properties"]
    assert "for" in props and "device" not in props


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_use_no_old_spelling(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MoetoolDeprecationWarning)
        load_recipe(path)


def test_a_target_its_profile_does_not_run_is_refused_by_field_and_file():
    with pytest.raises(
        RecipeError,
        match=r"r.yaml:7: targets\.0\.target: the deployment profile mac-16gb runs mlx, gguf, not onnx; give one of "
        r"those, leave `target` out \(the profile's first, mlx\)",
    ):
        parse_recipe(MOFE + "  - {for: mac-16gb, target: onnx}\n", Path("r.yaml"))


def test_validate_and_build_refuse_a_target_its_profile_does_not_run_before_any_work(tmp_path, monkeypatch):
    """`moetool validate` said ok, and `moetool build` merged and tuned before its export refused the pair."""
    from typer.testing import CliRunner

    from moetool import api
    from moetool.api import pipeline
    from moetool.cli import app

    def merged(*args: object, **kw: object) -> None:
        raise AssertionError("the build merged before refusing")

    monkeypatch.setattr(pipeline, "assemble", merged)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(MOFE + "  - {for: laptop}\n  - {for: mac-16gb, target: onnx}\n")
    said = "targets.1.target: the deployment profile mac-16gb runs mlx, gguf, not onnx"
    r = CliRunner().invoke(app, ["validate", str(recipe)])
    assert r.exit_code == 2 and said in " ".join(r.output.split()) and str(recipe) in r.output, r.output
    r = CliRunner().invoke(app, ["build", str(recipe), "-o", str(tmp_path / "run")])
    assert r.exit_code == 2 and said in " ".join(r.output.split()), r.output
    with pytest.raises(RecipeError, match=said):
        api.build(recipe, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_quant_that_does_not_parse_is_named_under_quant():
    with pytest.raises(RecipeError, match=r"r.yaml:7: targets\.0\.quant\.preset: unknown preset .nonsense."):
        parse_recipe(MOFE + "  - {target: gguf, quant: nonsense}\n", Path("r.yaml"))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("  - name: generalist\n", "  - name: g\n  - name: g\n", r"generalists\.1\.name: duplicate expert name 'g' "),
        ("  - name: legal\n", "  - name: code\n", r"users\.1\.name: duplicate user name 'code' \(also users\.0\)"),
        ("[{name: legal-s1}]", "[{name: code-s1}]", r"users\.1\.specialists\.0\.name: 'code-s1' is also users\.0"),
    ],
)
def test_a_comigs_name_given_twice_names_both_places(old, new, expected):
    text = (ROOT / "recipes" / "demo-comigs.yaml").read_text()
    assert old in text
    with pytest.raises(RecipeError, match=expected):
        parse_recipe(text.replace(old, new, 1), ROOT / "recipes" / "c.yaml")
