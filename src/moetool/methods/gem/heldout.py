"""Each domain's held-out text for a GEM model, from the recipe it was built from (kept as moetool-recipe.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetool.errors import MoetoolError
from moetool.io.safe import read_text
from moetool.recipe.gem import GemRecipe
from moetool.recipe.load import parse_recipe
from moetool.train.data import load_source

RECIPE = "moetool-recipe.yaml"


def built_recipe(model_dir: Path) -> GemRecipe:
    """The recipe a GEM model or bundle was merged from.

    Raises:
        MoetoolError: no moetool-recipe.yaml, or not a GEM recipe.
    """
    path = Path(model_dir) / RECIPE
    if not path.is_file():
        raise MoetoolError(f"{model_dir}: no {RECIPE} (not written by `moetool merge` for method: gem)")
    recipe: Any = parse_recipe(read_text(path, what="the model's recipe", error=MoetoolError), path)
    if not isinstance(recipe, GemRecipe):
        raise MoetoolError(f"{path}: method {recipe.method!r}, not gem")
    return recipe


def domain_held_out(model_dir: Path) -> dict[str, str]:
    """Domain name → its held-out text (the split router training left out), whatever the source: zoo, a local
    text or JSONL file (absolute in the kept recipe), or a cached dataset.

    Raises:
        MoetoolError: no kept recipe, or a domain whose text cannot be read (naming ``train.data.<domain>``).
    """
    recipe = built_recipe(model_dir)
    return {d.name: load_source(d.name, d.data, base_dir=None, fraction=0.1, seed=0)[1] for d in recipe.domains}
