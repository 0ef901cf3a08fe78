"""What every recipe shares: strict sections, and a whole recipe that remembers the file it was read from.

Recipe models share :class:`moetool.strict.StrictModel` (defined outside this package so that modules the recipes
use, such as ``moetool.quant.plan``, can import it without importing the recipe loader).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import ConfigDict, PrivateAttr, model_validator

from moetool.errors import deprecated
from moetool.strict import StrictModel


class RecipeBase(StrictModel):
    """A whole recipe (one per method): ``name``, ``method`` and where it came from.

    The loader records the file and its text, so every stage takes this object alone: relative model paths resolve
    against :attr:`recipe_dir`, and a model folder keeps the recipe as ``moetool-recipe.yaml``
    (:mod:`moetool.recipe.kept`: the one writer and the one reader of that file).
    """

    name: str
    method: str

    _path: Path | None = PrivateAttr(default=None)
    _text: str | None = PrivateAttr(default=None)

    def with_origin(self, path: Path | None, text: str | None) -> RecipeBase:
        """Record the file and text this recipe was read from (returns self)."""
        self._path = path
        self._text = text
        return self

    @property
    def path(self) -> Path | None:
        """The recipe file, or None for a recipe built in Python."""
        return self._path

    @property
    def recipe_dir(self) -> Path:
        """Where relative model paths resolve first: the recipe file's folder, else the working directory."""
        return self._path.parent if self._path is not None else Path(".")

    @property
    def text(self) -> str:
        """The YAML the recipe was read from, or a dump of it when built in Python."""
        if self._text is not None:
            return self._text
        result: str = yaml.safe_dump(self.model_dump(mode="json", exclude_unset=True), sort_keys=False)
        return result


def renamed_key(data: Any, old: str, new: str, section: str) -> Any:
    """A section's raw mapping with the old spelling ``old`` of key ``new`` read as ``new``, and a deprecation
    warning naming both (for a ``mode="before"`` validator; the old key is read for one release).

    Raises:
        ValueError: both spellings are given.
    """
    if not isinstance(data, dict) or old not in data:
        return data
    if new in data:
        raise ValueError(f"{old}: the old spelling of `{new}`, which is also given; keep only `{new}`")
    deprecated(
        f"{section}: `{old}: {data[old]}` is the old spelling; write `{new}: {data[old]}` "
        f"(`{old}:` is still read in this release, not in the next)"
    )
    return {(new if k == old else k): v for k, v in data.items()}


class ForSection(StrictModel):
    """A section whose deployment profile or device is its ``for:`` key (``device:`` is its old spelling, still
    read). ``for`` is a Python keyword: a subclass's field is ``for_``, read and written as ``for``."""

    model_config = ConfigDict(**StrictModel.model_config, serialize_by_alias=True)
    section: ClassVar[str]  # the section's name in the deprecation warning

    @model_validator(mode="before")
    @classmethod
    def _old_spelling(cls, data: Any) -> Any:
        return renamed_key(data, "device", "for", cls.section)


def unique_names(names: Iterable[str], path: str, what: str) -> dict[str, str]:
    """Each name of the list at ``path`` with its place (``{path}.{i}``), for checks across lists.

    Raises:
        ValueError: a name given twice, naming both places, as a recipe validator reports it.
    """
    seen: dict[str, str] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise ValueError(f"{path}.{i}.name: duplicate {what} {name!r} (also {seen[name]})")
        seen[name] = f"{path}.{i}"
    return seen


__all__ = ["ForSection", "RecipeBase", "StrictModel", "renamed_key", "unique_names"]
