"""The ``hybrid`` plugin: two experts of any architectures behind a tiny cost-aware router (trained in assemble);
its export is the router as its own ONNX graph plus each expert through the standard exporters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from moetool import registry
from moetool.export.base import Exporter, ExportRequest
from moetool.methods.base import FunctionExporter, MethodExportPlan, MethodPlugin
from moetool.recipe.base import RecipeBase


def _export(target: str) -> Any:
    def run(req: ExportRequest, console: Console) -> dict[str, Any]:
        from moetool.methods.hybrid.export import export_hybrid

        return export_hybrid(
            req.model_dir, req.output, expert_target=target, quant=req.options.get("quant"), force=req.force,
            verify=req.verify, experts=req.options.get("experts", True), console=console,
        )  # fmt: skip

    return run


class HybridPlugin(MethodPlugin):
    name = "hybrid"
    marker_files = ("hybrid.json",)
    export_targets = tuple(registry.TARGETS)

    def _assembler(self) -> Any:
        from moetool.methods.hybrid.assemble import HybridAssembler

        return HybridAssembler()

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
        target = target or "gguf"
        if target not in self.export_targets:
            raise self.refuse_target(model_dir, target)
        return FunctionExporter(
            name=target,
            requires=registry.TARGETS[target],
            description=f"hybrid: router.onnx (onnxruntime parity) + each expert as {target} + manifest + dispatcher",
            fn=_export(target),
        )
