"""A model folder's recipe (moetool.recipe.kept): one writer, one reader, and no other module that names the file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from moetool.errors import RecipeError
from moetool.recipe import load_recipe
from moetool.recipe.kept import KEPT_RECIPE, kept_recipe_text, read_kept_recipe, write_kept_recipe
from moetool.recipe.load import parse_recipe

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "moetool"


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_reads_back_as_it_was_written(path, tmp_path):
    recipe = load_recipe(path)
    text = write_kept_recipe(tmp_path, recipe)
    assert (tmp_path / KEPT_RECIPE).read_text(encoding="utf-8") == text
    again = read_kept_recipe(tmp_path)
    assert again is not None and type(again) is type(recipe)
    assert again.model_dump() == recipe.model_dump()
    assert kept_recipe_text(again) == text  # written once: a second write is the same text


def test_local_data_files_are_kept_absolute(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "code.txt").write_text("def f(): pass\n\n" * 20)
    text = (
        "name: t\nmethod: mofe\nbase_model: zoo:base\ngate_mode: random\n"
        "experts: [{name: a, source: zoo:code}, {name: b, source: zoo:legal}]\n"
        "train: {data: {code: {text: data/code.txt}, legal: {zoo: legal}}, steps: 3}\n"
        "targets: [{for: raspberry-pi-4}]\n"
    )
    recipe = parse_recipe(text, tmp_path / "r.yaml")
    folder = tmp_path / "elsewhere" / "model"
    folder.mkdir(parents=True)
    kept = yaml.safe_load(write_kept_recipe(folder, recipe))
    assert kept["train"]["data"]["code"]["text"] == str((tmp_path / "data" / "code.txt").resolve())
    assert kept["train"]["data"]["legal"] == {"zoo": "legal"} and kept["train"]["steps"] == 3
    assert kept["targets"] == [{"for": "raspberry-pi-4"}]  # its recipe names, not the Python ones
    assert "freeze" not in kept  # the keys given: defaults are the reader's to fill
    again = read_kept_recipe(folder)
    assert again is not None and again.train.data["code"].text == kept["train"]["data"]["code"]["text"]
    assert "train" in again.model_fields_set and "freeze" not in again.model_fields_set


def test_the_reader_validates_like_load_recipe(tmp_path):
    assert read_kept_recipe(tmp_path) is None
    (tmp_path / KEPT_RECIPE).write_text("name: t\nmethod: mofe\nbase_model: zoo:base\nexperts: []\ncolour: red\n")
    with pytest.raises(RecipeError, match=rf"{KEPT_RECIPE}:5: colour: unknown key"):
        read_kept_recipe(tmp_path)


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    """String constants that are not docstrings (a docstring is an expression statement)."""
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_other_module_names_the_kept_recipe_file():
    """Writing or reading the file goes through moetool.recipe.kept; others name it by KEPT_RECIPE only to carry it."""
    naming = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "recipe" / "kept.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(KEPT_RECIPE in c.value for c in _string_constants(tree)):
            naming.append(str(path.relative_to(SRC)))
    assert not naming, f"name moetool-recipe.yaml only through moetool.recipe.kept: {naming}"
