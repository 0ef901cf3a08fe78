"""Merge methods: each turns a validated recipe into a model.

Two kinds of plugin:
- ``MergeMethod`` (mofe): a weight-free tensor plan first (``--dry-run`` prints it), then a streamed copy.
- ``Assembler`` (comigs, gem, hybrid, embedding): methods whose output is a moetool model class or a set of
  artifacts rather than a tensor-for-tensor copy; they describe what they will build, then build it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from moetool.methods.base import MergePlan
from moetool.methods.mofe import MoFEMethod


class MergeMethod(Protocol):
    name: str

    def plan(self, recipe: object, *, recipe_dir: Path | None = None, allow_pickle: bool = False) -> MergePlan: ...


class Assembler(Protocol):
    name: str

    def describe(self, recipe: Any, *, recipe_dir: Path) -> str:
        """What ``assemble`` would build (printed by ``moetool merge --dry-run``); reads no weights."""
        ...

    def assemble(self, recipe: Any, *, recipe_dir: Path, output: Path, force: bool = False, console: Any = None) -> Path:
        """Build the model into ``output`` atomically (refusing an existing one without ``force``); returns it."""
        ...


METHODS: dict[str, MergeMethod] = {"mofe": MoFEMethod()}
# method name -> assembler; each method package registers itself here (see register_assembler).
ASSEMBLERS: dict[str, Assembler] = {}


def register_assembler(assembler: Assembler) -> Assembler:
    ASSEMBLERS[assembler.name] = assembler
    return assembler


__all__ = ["ASSEMBLERS", "METHODS", "Assembler", "MergeMethod", "MergePlan", "register_assembler"]
