"""The one plugin registry: merge methods, export targets and model-source resolvers, named as data.

Every entry is a ``"module:attribute"`` string imported on first use, so ``moetool --help`` and a ``mofe`` merge never
import the other methods (or torch), and no layer needs a static import of a layer above it to find a plugin.
This module imports nothing of moetool's but :mod:`moetool.errors`; every layer may read it.

Adding a method is one line in :data:`METHODS` (see docs/architecture.md); an exporter, one line in :data:`TARGETS`; a
model-source scheme (``zoo:NAME``), one line in :data:`SOURCES`.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from moetool.errors import MoetoolError


@dataclass(frozen=True)
class MethodEntry:
    """Where a method's parts live.

    Attributes:
        recipe: its recipe model (a pydantic class in :mod:`moetool.recipe`, the low layer every stage reads).
        plugin: its :class:`moetool.methods.base.MethodPlugin` instance (plan/assemble/train/evaluate/export).
        cli: its optional Typer sub-app (``moetool NAME …``), or None.
        commands: extra top-level commands it adds, as ``(name, "module:function")`` pairs.
    """

    recipe: str
    plugin: str
    cli: str | None = None
    commands: tuple[tuple[str, str], ...] = ()


METHODS: dict[str, MethodEntry] = {
    "mofe": MethodEntry("moetool.recipe.mofe:MoFERecipe", "moetool.methods.mofe:PLUGIN"),
    "comigs": MethodEntry(
        "moetool.recipe.comigs:ComigsRecipe", "moetool.methods.comigs:PLUGIN", "moetool.cli.methods.comigs:app"
    ),
    "embedding": MethodEntry(
        "moetool.recipe.embedding:EmbeddingRecipe",
        "moetool.methods.embedding:PLUGIN",
        "moetool.cli.methods.embedding:app",
    ),
    "gem": MethodEntry("moetool.recipe.gem:GemRecipe", "moetool.methods.gem:PLUGIN", "moetool.cli.methods.gem:app"),
    "hybrid": MethodEntry(
        "moetool.recipe.hybrid:HybridRecipe",
        "moetool.methods.hybrid:PLUGIN",
        "moetool.cli.methods.hybrid:app",
        commands=(("profile", "moetool.cli.methods.hybrid:profile_cmd"),),
    ),
}

# standard export targets: target -> its Exporter class (moetool.export.base.Exporter)
TARGETS: dict[str, str] = {
    "gguf": "moetool.export.gguf.exporter:GGUFExporter",
    "onnx": "moetool.export.onnx.exporter:ONNXExporter",
    "executorch": "moetool.export.executorch.exporter:ExecuTorchExporter",
    "coreml": "moetool.export.coreml.exporter:CoreMLExporter",
    "tflite": "moetool.export.tflite.exporter:TFLiteExporter",
    "mlx": "moetool.export.mlx.exporter:MLXExporter",
}

# model-source schemes (``zoo:NAME``): scheme -> its resolver, a ``moetool.io.sources.SourceResolver`` (the folder of a
# model, the scheme's text domains and their train/held-out text). The zoo sits above the layers that read it (io,
# train, export): they reach it through ``moetool.io.sources.source_resolver``, never by import
SOURCES: dict[str, str] = {
    "zoo": "moetool.zoo.plugin:SOURCE",
}


class UnknownPluginError(MoetoolError):
    """A method, target or scheme name that is not registered."""


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """``" (did you mean 'gguf'?)"`` for a close registered name, else the list of known names."""
    names = sorted(known)
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}? known: {', '.join(names)}"
    return f"known: {', '.join(names)}"


def load(spec: str) -> Any:
    """Import ``"module:attribute"`` and return the attribute."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


EntryT = TypeVar("EntryT")


def _registered(table: Mapping[str, EntryT], name: object, refusal: Callable[[str], str]) -> EntryT:
    """``table[name]``.

    Raises:
        UnknownPluginError: ``name`` is not in ``table``, saying ``refusal`` of the "did you mean" hint.
    """
    if not isinstance(name, str) or name not in table:
        raise UnknownPluginError(refusal(did_you_mean(name, table)))
    return table[name]


def method_entry(name: object) -> MethodEntry:
    """The registry entry of method ``name``.

    Raises:
        UnknownPluginError: not a registered method (with "did you mean").
    """
    return _registered(METHODS, name, lambda hint: f"method: {name!r} is not a known method ({hint})")


def target_spec(target: object) -> str:
    """The ``"module:Class"`` of the exporter of ``target``.

    Raises:
        UnknownPluginError: not a registered target (with "did you mean").
    """
    return _registered(TARGETS, target, lambda hint: f"unknown target {target!r} ({hint})")


def load_all_methods() -> None:
    """Import every method plugin's model modules.

    That registers moetool's own model classes (``moetool_gem``, …) with transformers' Auto classes, so
    ``AutoModelForCausalLM.from_pretrained`` loads any moetool output.
    """
    for entry in METHODS.values():
        for module in load(entry.plugin).model_modules:
            importlib.import_module(module)
