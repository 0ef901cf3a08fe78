"""The ``gem`` plugin: pathways behind a confidence-threshold router; its outputs export through its own exporters
(token level: one graph with the router and threshold inside; sequence level: router + one artifact per pathway)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from moetool import registry
from moetool.errors import MoetoolError
from moetool.export.base import Exporter, ExportError, ExportRequest
from moetool.io.jsontypes import JsonObject
from moetool.methods.base import AssemblerPlugin, FunctionExporter, MethodExportPlan
from moetool.recipe.gem import GemRecipe

TOKEN_TARGETS = ("onnx", "tflite")


def _token_onnx(req: ExportRequest, console: Console) -> JsonObject:
    from moetool.methods.gem.export import export_token_onnx

    return export_token_onnx(
        req.model_dir, req.output, quant=req.options.get("quant"), force=req.force, verify=req.verify
    )


def _token_tflite(req: ExportRequest, console: Console) -> JsonObject:
    from moetool.methods.gem.export import export_token_tflite

    if req.options.get("quant") is not None:
        raise MoetoolError("--quant: the token-level TFLite graph is exported in fp32 only")
    return export_token_tflite(req.model_dir, req.output, force=req.force, verify=req.verify)


def _sequence(req: ExportRequest, target: str, console: Console) -> JsonObject:
    from moetool.methods.gem.export import export_sequence_bundle

    return export_sequence_bundle(
        req.model_dir, req.output, target=target, quant=req.options.get("quant"), force=req.force,
        verify=req.verify, console=console,
    )  # fmt: skip


class GemPlugin(AssemblerPlugin[GemRecipe]):
    name = "gem"
    assembler = "moetool.methods.gem.assembler:GemAssembler"
    model_types = ("moetool_gem",)
    model_modules = ("moetool.methods.gem.model",)
    marker_files = ("gem.json",)
    export_targets = (*TOKEN_TARGETS, *(t for t in registry.TARGETS if t not in TOKEN_TARGETS))

    def target_keys(self, recipe: GemRecipe) -> dict[str, tuple[str, ...]]:
        """Token level: one graph, onnx (``quant`` by role) or tflite (float32 only); sequence level: every target,
        ``quant`` for the pathways."""
        if recipe.level == "token":
            return {"onnx": ("quant",), "tflite": ()}
        return {t: ("quant",) for t in self.export_targets}

    def target_note(self, recipe: GemRecipe) -> str:
        return f" (level: {recipe.level})"

    def exporter(self, model_dir: Path, target: str | None) -> Exporter[MethodExportPlan]:
        if (model_dir / "gem.json").is_file():
            return self.function_exporter(
                model_dir,
                target or "gguf",
                _sequence,
                lambda t: f"sequence-level GEM: router.onnx + one {t} artifact per pathway + manifest.json",
            )
        target = target or "onnx"
        if target == "onnx":
            return FunctionExporter("onnx", "onnx", "token-level GEM: one ONNX graph, router and τ inside", _token_onnx)
        if target == "tflite":
            return FunctionExporter("tflite", "tflite", "token-level GEM: one TFLite graph (fp32)", _token_tflite)
        raise ExportError(
            f"{model_dir} is a token-level gem model: --target {target!r} is not supported (supported: onnx, tflite)"
        )
