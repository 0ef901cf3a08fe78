"""A model folder's recipe, ``moetool-recipe.yaml``: written one way, read one way.

Every method's merge keeps the recipe its output was built from beside the weights (:func:`write_kept_recipe`), and
whatever reads it back later (an export's quantization section and calibration text, ``moetool gem eval``'s held-out
text) reads it through :func:`read_kept_recipe`, validated as :func:`~moetool.recipe.load.load_recipe` validates a
recipe file. The text is the validated recipe serialised once: the keys it was given (defaults are filled in again
when it is read), with each local data file (``text:``/``jsonl:``) made absolute, so the folder's recipe still finds
its text wherever the model is moved to or read from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from moetool.errors import RecipeError
from moetool.io.safe import read_bytes
from moetool.recipe.base import RecipeBase
from moetool.recipe.load import MAX_RECIPE_BYTES, parse_recipe
from moetool.recipe.train import DataSource

KEPT_RECIPE = "moetool-recipe.yaml"


def kept_recipe_text(recipe: RecipeBase) -> str:
    """``recipe`` as the YAML a model folder keeps: its given keys (by their recipe names: ``for``), local data files
    absolute (resolved against the recipe's folder)."""
    data = recipe.model_dump(mode="json", exclude_unset=True, by_alias=True)
    _absolute_data_files(recipe, data, recipe.recipe_dir)
    text: str = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    return text


def _absolute_data_files(value: Any, dumped: Any, base: Path) -> None:
    """Rewrite, in ``dumped`` (``value``'s dump), every relative ``text:``/``jsonl:`` of a :class:`DataSource` that
    names a file under ``base`` as its absolute path."""
    if isinstance(value, DataSource) and isinstance(dumped, dict):
        for key in ("text", "jsonl"):
            raw = getattr(value, key)
            if key in dumped and raw and not Path(raw).is_absolute() and (base / raw).is_file():
                dumped[key] = str((base / raw).resolve())
    elif isinstance(value, BaseModel) and isinstance(dumped, dict):
        for name, info in type(value).model_fields.items():
            key = info.alias or name
            if key in dumped:
                _absolute_data_files(getattr(value, name), dumped[key], base)
    elif isinstance(value, list | tuple) and isinstance(dumped, list):
        for item, sub in zip(value, dumped, strict=False):
            _absolute_data_files(item, sub, base)
    elif isinstance(value, dict) and isinstance(dumped, dict):
        for key, item in value.items():
            if key in dumped:
                _absolute_data_files(item, dumped[key], base)


def write_kept_recipe(folder: Path, recipe: RecipeBase) -> str:
    """Write ``recipe`` into ``folder`` (a merge's temporary output folder) as ``moetool-recipe.yaml``; returns the
    text written (what provenance hashes and the model card shows)."""
    text = kept_recipe_text(recipe)
    (Path(folder) / KEPT_RECIPE).write_text(text, encoding="utf-8")
    return text


def read_kept_recipe(model_dir: Path) -> RecipeBase | None:
    """The recipe ``model_dir`` was built from, validated (None when the folder keeps none).

    Raises:
        RecipeError: the file is too large, not UTF-8, not YAML or not a valid recipe (file, field and line named).
    """
    path = Path(model_dir) / KEPT_RECIPE
    if not path.is_file():
        return None
    raw = read_bytes(path, what="the model's recipe", error=RecipeError, max_bytes=MAX_RECIPE_BYTES)
    return parse_recipe(raw, path)
