"""Merge methods: each turns a validated recipe into a model.

Two kinds of plugin:
- ``MergeMethod`` (mofe): a weight-free tensor plan first (``--dry-run`` prints it), then a streamed copy.
- ``Assembler`` (comigs, gem, hybrid, embedding): methods whose output is a moetool model class or a set of
  artifacts rather than a tensor-for-tensor copy; they describe what they will build, then build it.
"""

from __future__ import annotations

import importlib
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

    def assemble(
        self, recipe: Any, *, recipe_dir: Path, output: Path, force: bool = False, console: Any = None
    ) -> Path:
        """Build the model into ``output`` atomically (refusing an existing one without ``force``); returns it."""
        ...


METHODS: dict[str, MergeMethod] = {"mofe": MoFEMethod()}
# method name -> assembler; each method package registers itself here (see register_assembler).
ASSEMBLERS: dict[str, Assembler] = {}


def register_assembler(assembler: Assembler) -> Assembler:
    ASSEMBLERS[assembler.name] = assembler
    return assembler


def register_causal_lm(config_cls: Any, model_cls: Any) -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load checkpoints of ``config_cls.model_type`` (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


# method -> the module whose import registers its assembler (and its model classes with transformers' Auto
# classes). Imported on first use, so `moetool merge` of a mofe recipe never loads the other methods.
PLUGINS: dict[str, str] = {
    "comigs": "moetool.methods.comigs.pipeline",
    "embedding": "moetool.methods.embedding",
    "gem": "moetool.methods.gem",
    "hybrid": "moetool.methods.hybrid",
}


def get_assembler(method: str) -> Assembler | None:
    """The assembler of ``method`` (importing its plugin), or None for tensor-plan methods such as mofe."""
    if method in PLUGINS and method not in ASSEMBLERS:
        importlib.import_module(PLUGINS[method])
    return ASSEMBLERS.get(method)


def register_model_classes() -> None:
    """Register every moetool model class (``moetool_comigs``, ``moetool_gem``, ``moetool_routed_embedding``, …)
    with transformers' Auto classes, so ``AutoModelForCausalLM.from_pretrained`` loads moetool's own outputs."""
    for module in PLUGINS.values():
        importlib.import_module(module)


__all__ = [
    "ASSEMBLERS",
    "METHODS",
    "PLUGINS",
    "Assembler",
    "MergeMethod",
    "MergePlan",
    "get_assembler",
    "register_assembler",
    "register_causal_lm",
    "register_model_classes",
]
