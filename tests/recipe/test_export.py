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
