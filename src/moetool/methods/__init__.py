"""Merge methods: each turns a validated recipe into a plan, then executes it."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from moetool.methods.base import MergePlan
from moetool.methods.mofe import MoFEMethod


class MergeMethod(Protocol):
    name: str

    def plan(self, recipe: object, *, recipe_dir: Path | None = None, allow_pickle: bool = False) -> MergePlan: ...


METHODS: dict[str, MergeMethod] = {"mofe": MoFEMethod()}

__all__ = ["METHODS", "MergeMethod", "MergePlan"]
