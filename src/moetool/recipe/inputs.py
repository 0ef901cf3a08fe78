"""The local files and folders a recipe reads, so an output is never written into, over or around one of them."""

from __future__ import annotations

import contextlib
from pathlib import Path

from pydantic import BaseModel

from moetool.errors import MoetoolError
from moetool.io.sources import resolve_source
from moetool.recipe.base import RecipeBase

# fields that hold text, never a path: a prompt that happens to match a folder name is not an input
FREE_TEXT = frozenset({"name", "positive_prompts", "negative_prompts", "questions"})


def recipe_inputs(recipe: RecipeBase) -> list[Path]:
    """Every local file or folder the recipe reads: its own file, the models it names (``zoo:``, dirs, cached repo
    ids) and data files. An output may not be, sit inside, or contain any of them."""
    found: list[Path] = [recipe.path] if recipe.path is not None else []

    def walk(value: object) -> None:
        if isinstance(value, BaseModel):
            for name in type(value).model_fields:
                if name not in FREE_TEXT:
                    walk(getattr(value, name))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, str | Path) and str(value).strip() and "\n" not in str(value):
            local = Path(value) if Path(value).is_absolute() else recipe.recipe_dir / value
            if Path(value).exists() or local.exists():
                found.append(local if local.exists() else Path(value))
            elif str(value).startswith("zoo:"):
                with contextlib.suppress(MoetoolError):
                    found.append(resolve_source(str(value)).path)

    walk(recipe)
    return found
