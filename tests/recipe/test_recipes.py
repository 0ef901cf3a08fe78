"""Recipes: every shipped recipe validates; errors name the file, the field path and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetool.errors import RecipeError
from moetool.recipe import load_recipe
from moetool.recipe.load import recipe_json_schema

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))

GOOD = """\
name: ok
method: mofe
base_model: zoo:base
experts:
  - name: code
    source: zoo:code
    positive_prompts: ["def main():"]
  - name: legal
    source: zoo:legal
    positive_prompts: ["licence"]
"""


def test_recipes_are_shipped():
    assert SHIPPED, "recipes/ must hold at least one recipe"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipe_validates(path):
    r = load_recipe(path)
    assert r.name


def _err(tmp_path, text):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(p)
    return str(info.value)


def test_good_recipe(tmp_path):
    p = tmp_path / "good.yaml"
    p.write_text(GOOD)
    r = load_recipe(p)
    assert r.experts_per_token == 2 and r.gate_mode == "hidden" and [e.name for e in r.experts] == ["code", "legal"]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda t: t.replace("  - name: legal\n", "  - name: legal\n    colour: red\n"),
            "bad.yaml:9: experts.1.colour: unknown key",
        ),
        (lambda t: t + "gate_mod: random\n", "bad.yaml:11: gate_mod: unknown key"),
        (
            lambda t: t + "experts_per_token: 3\n",
            "experts_per_token: 3 is larger than the number of experts (2)",
        ),
        (
            lambda t: t.replace("name: legal", "name: code"),
            "bad.yaml:8: experts.1.name: duplicate expert name 'code'",
        ),
        (
            lambda t: t.replace('    positive_prompts: ["licence"]\n', ""),
            "experts.1.positive_prompts: expert 'legal' has no positive prompts",
        ),
        (
            lambda t: t.replace("method: mofe", "method: nope"),
            "bad.yaml:2: method: 'nope' is not a known method",
        ),
        (lambda t: t + "architecture: switch\n", "bad.yaml:11: architecture: Input should be"),
        (
            lambda t: t + "experts_per_token: 0\n",
            "experts_per_token: Input should be greater than or equal to 1",
        ),
        (
            lambda t: t + "shared_expert: {source: zoo:base}\narchitecture: mixtral\n",
            "shared_expert: only the qwen2_moe architecture has a shared expert",
        ),
        (lambda t: t + "  - [oops\n", "bad.yaml:12: not valid YAML: expected ',' or ']'"),
    ],
)
def test_errors_name_field_and_line(tmp_path, edit, expected):
    msg = _err(tmp_path, edit(GOOD))
    assert expected in msg, msg
    assert "bad.yaml" in msg


def test_missing_field_is_named(tmp_path):
    msg = _err(tmp_path, GOOD.replace("base_model: zoo:base\n", ""))
    assert "base_model: Field required" in msg


def test_missing_file():
    with pytest.raises(RecipeError, match="cannot read recipe"):
        load_recipe("/nonexistent/recipe.yaml")


def test_schema_lists_mofe():
    schema = recipe_json_schema()
    json.dumps(schema)
    assert "MoFERecipe" in schema["$defs"]
    props = schema["$defs"]["MoFERecipe"]["properties"]
    assert {"base_model", "experts", "gate_mode", "architecture", "shared_expert"} <= set(props)
    assert schema["$defs"]["MoFERecipe"]["additionalProperties"] is False


def test_nested_validator_error_keeps_the_path_to_its_model(tmp_path):
    """A cross-field check inside a nested section names its field relative to that section; the error must carry
    the whole path (section.field), not the relative one."""
    import yaml
    from pydantic import ValidationError, model_validator

    from moetool.io.safe import parse_yaml
    from moetool.recipe.load import _errors
    from moetool.strict import StrictModel

    class Inner(StrictModel):
        a: int = 1
        b: int = 2

        @model_validator(mode="after")
        def _check(self) -> Inner:
            if self.a > self.b:
                raise ValueError(f"b: {self.b} is smaller than a ({self.a})")
            return self

    class Outer(StrictModel):
        name: str
        section: Inner

    text = "name: x\nsection:\n  a: 3\n  b: 1\n"
    with pytest.raises(ValidationError) as info:
        Outer.model_validate(yaml.safe_load(text))
    _, lines = parse_yaml(text, tmp_path / "r.yaml")
    [msg] = _errors(info.value, tmp_path / "r.yaml", lines)
    assert msg == f"{tmp_path / 'r.yaml'}:4: section.b: 1 is smaller than a (3)"
