"""The ``embedding`` plugin: a context-routed input embedding retrofitted onto a causal LM (trained in assemble);
its outputs export to the graph targets with the router and body as standard ops (llama.cpp has no such
architecture, so no GGUF)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from moetool.export.base import Exporter, ExportError, ExportRequest
from moetool.io.jsontypes import JsonObject
from moetool.methods.base import AssemblerPlugin, MethodExportPlan
from moetool.recipe.embedding import EmbeddingRecipe


def _export(req: ExportRequest, target: str, console: Console) -> JsonObject:
    if req.options.get("quant") is not None:  # refused rather than ignored: the graphs are float32
        raise ExportError(f"--quant: routed-embedding models export in float32 only ({target})")
    from moetool.methods.embedding.export import export_routed

    return export_routed(req.model_dir, target, req.output, force=req.force, eval_text=req.eval_text)


class EmbeddingPlugin(AssemblerPlugin[EmbeddingRecipe]):
    name = "embedding"
    assembler = "moetool.methods.embedding.assemble:EmbeddingAssembler"
    model_types = ("moetool_routed_embedding",)
    model_modules = ("moetool.methods.embedding.model",)
    export_targets = ("onnx", "tflite", "coreml")

    def target_keys(self, recipe: EmbeddingRecipe) -> dict[str, tuple[str, ...]]:
        """Every graph target, none of which reads ``quant`` (float32 only)."""
        return {t: () for t in self.export_targets}

    def exporter(self, model_dir: Path, target: str | None) -> Exporter[MethodExportPlan]:
        return self.function_exporter(
            model_dir, target, _export, lambda t: f"routed-embedding model as {t}: router and body as standard ops"
        )
