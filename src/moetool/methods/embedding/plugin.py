"""The ``embedding`` plugin: a context-routed input embedding retrofitted onto a causal LM (trained in assemble);
its outputs export to the graph targets with the router and body as standard ops (llama.cpp has no such
architecture, so no GGUF)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from moetool.export.base import Exporter, ExportRequest
from moetool.methods.base import FunctionExporter, MethodExportPlan, MethodPlugin
from moetool.recipe.base import RecipeBase


def _export(target: str) -> Any:
    def run(req: ExportRequest, console: Console) -> dict[str, Any]:
        from moetool.methods.embedding.export import export_routed

        return export_routed(req.model_dir, target, req.output, force=req.force, eval_text=req.eval_text)

    return run


class EmbeddingPlugin(MethodPlugin):
    name = "embedding"
    model_types = ("moetool_routed_embedding",)
    model_modules = ("moetool.methods.embedding.model",)
    export_targets = ("onnx", "tflite", "coreml")

    def _assembler(self) -> Any:
        from moetool.methods.embedding.assemble import EmbeddingAssembler

        return EmbeddingAssembler()

    def describe(self, recipe: RecipeBase, *, allow_pickle: bool = False) -> str:
        text: str = self._assembler().describe(recipe, recipe_dir=recipe.recipe_dir)
        return text

    def assemble(
        self, recipe: RecipeBase, output: Path, *, force: bool = False, allow_pickle: bool = False, console: Console
    ) -> Path:
        return Path(
            self._assembler().assemble(
                recipe, recipe_dir=recipe.recipe_dir, output=output, force=force, console=console
            )
        )

    def exporter(self, model_dir: Path, target: str | None) -> Exporter[MethodExportPlan]:
        target = target or "onnx"
        if target not in self.export_targets:
            raise self.refuse_target(model_dir, target)
        return FunctionExporter(
            name=target,
            requires=target,
            description=f"routed-embedding model as {target}: router and body as standard ops, checked in its runtime",
            fn=_export(target),
        )
