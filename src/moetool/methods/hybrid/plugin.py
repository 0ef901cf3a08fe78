"""The ``hybrid`` plugin: two experts of any architectures behind a tiny cost-aware router (trained in assemble);
its export is the router as its own ONNX graph plus each expert through the standard exporters."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from moetool import registry
from moetool.export.base import Exporter, ExportRequest
from moetool.io.jsontypes import JsonObject
from moetool.methods.base import AssemblerPlugin, MethodExportPlan
from moetool.recipe.hybrid import HybridRecipe


def _export(req: ExportRequest, target: str, console: Console) -> JsonObject:
    from moetool.methods.hybrid.export import export_hybrid

    return export_hybrid(
        req.model_dir,
        req.output,
        expert_target=target,
        quant=req.options.get("quant"),
        force=req.force,
        verify=req.verify,
        experts=req.options.get("experts", True),
        console=console,
    )


class HybridPlugin(AssemblerPlugin[HybridRecipe]):
    name = "hybrid"
    assembler = "moetool.methods.hybrid.assemble:HybridAssembler"
    marker_files = ("hybrid.json",)
    export_targets = tuple(registry.TARGETS)

    def exporter(self, model_dir: Path, target: str | None) -> Exporter[MethodExportPlan]:
        return self.function_exporter(
            model_dir, target, _export, lambda t: f"hybrid: router.onnx + each expert as {t} + manifest + dispatcher"
        )
