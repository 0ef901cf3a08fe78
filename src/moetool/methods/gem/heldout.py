"""Each domain's held-out text for a GEM model, from the recipe it was built from (kept as moetool-recipe.yaml)."""

from __future__ import annotations

from pathlib import Path

from moetool.errors import MoetoolError
from moetool.recipe.gem import GemRecipe
from moetool.recipe.kept import KEPT_RECIPE, read_kept_recipe
from moetool.train.data import load_source


def built_recipe(model_dir: Path) -> GemRecipe:
    """The recipe a GEM model or bundle was merged from.

    Raises:
        MoetoolError: no moetool-recipe.yaml, or not a GEM recipe.
        RecipeError: the kept recipe is not a valid recipe (file, field and line named).
    """
    recipe = read_kept_recipe(model_dir)
    if recipe is None:
        raise MoetoolError(f"{model_dir}: no {KEPT_RECIPE} (not written by `moetool merge` for method: gem)")
    if not isinstance(recipe, GemRecipe):
        raise MoetoolError(f"{Path(model_dir) / KEPT_RECIPE}: method {recipe.method!r}, not gem")
    return recipe


def domain_held_out(model_dir: Path) -> dict[str, str]:
    """Domain name → its held-out text (the split router training left out), whatever the source: zoo, a local
    text or JSONL file (absolute in the kept recipe), or a cached dataset.

    Raises:
        MoetoolError: no kept recipe, or a domain whose text cannot be read (naming ``train.data.<domain>``).
    """
    recipe = built_recipe(model_dir)
    return {d.name: load_source(d.name, d.data, base_dir=None, fraction=0.1, seed=0)[1] for d in recipe.domains}
