"""The small Python API behind the CLI (usable from notebooks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from moetool.methods import METHODS, MergePlan
from moetool.recipe.load import load_recipe


def plan_merge(recipe_path: str | Path, *, allow_pickle: bool = False) -> MergePlan:
    """Validate the recipe and run preflight: no output is touched."""
    path = Path(recipe_path)
    recipe: Any = load_recipe(path)
    return METHODS[recipe.method].plan(recipe, recipe_dir=path.parent, allow_pickle=allow_pickle)


def merge(
    recipe_path: str | Path,
    output: str | Path,
    *,
    force: bool = False,
    allow_pickle: bool = False,
    console: Console | None = None,
) -> Path:
    """Plan and execute a merge; returns the output directory."""
    from moetool.merge import execute

    plan = plan_merge(recipe_path, allow_pickle=allow_pickle)
    text = Path(recipe_path).read_text(encoding="utf-8")
    return execute(plan, Path(output), force=force, recipe_text=text, console=console)
