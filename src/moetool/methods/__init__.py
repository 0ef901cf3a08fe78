"""Merge methods: each is one folder whose ``PLUGIN`` (a :class:`~moetool.methods.base.MethodPlugin`) the pipeline
drives: describe (``--dry-run``), assemble (``moetool merge``), train, export of its outputs.

The registry (:data:`moetool.registry.METHODS`) names them as data; plugins are imported on first use, so
``moetool merge`` of a mofe recipe never loads the other methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetool import registry
from moetool.methods.base import MethodPlugin, register_causal_lm


def get_plugin(method: str) -> MethodPlugin[Any, Any]:
    """The plugin of ``method`` (an unknown name gets "did you mean").

    Raises:
        RecipeError: no such method.
    """
    plugin: MethodPlugin[Any, Any] = registry.load(registry.method_entry(method).plugin)
    return plugin


def plugin_for_model(model_dir: Path) -> MethodPlugin[Any, Any] | None:
    """The method whose own model class or bundle ``model_dir`` is, or None for a standard transformers model."""
    for name in registry.METHODS:
        plugin = get_plugin(name)
        if (plugin.model_types or plugin.marker_files) and plugin.owns(model_dir):
            return plugin
    return None


def register_model_classes() -> None:
    """Register every moetool model class (``moetool_comigs``, ``moetool_gem``, ``moetool_routed_embedding``, …)
    with transformers' Auto classes, so ``AutoModelForCausalLM.from_pretrained`` loads moetool's own outputs."""
    registry.load_all_methods()


__all__ = ["MethodPlugin", "get_plugin", "plugin_for_model", "register_causal_lm", "register_model_classes"]
