"""The ``gem`` plugin: pathways behind a confidence-threshold router; its outputs export through its own exporters
(token level: one graph with the router and threshold inside; sequence level: router + one artifact per pathway)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from moetool import registry
from moetool.errors import MoetoolError
from moetool.export.base import Exporter, ExportError, ExportRequest
from moetool.methods.base import FunctionExporter, MethodExportPlan, MethodPlugin
from moetool.recipe.base import RecipeBase

TOKEN_TARGETS = ("onnx", "tflite")


def _token_onnx(req: ExportRequest, console: Console) -> dict[str, Any]:
    from moetool.methods.gem.export import export_token_onnx

    return export_token_onnx(
        req.model_dir, req.output, quant=req.options.get("quant"), force=req.force, verify=req.verify
    )


def _token_tflite(req: ExportRequest, console: Console) -> dict[str, Any]:
    from moetool.methods.gem.export import export_token_tflite

    if req.options.get("quant") is not None:
        raise MoetoolError("--quant: the token-level TFLite graph is exported in fp32 only")
    return export_token_tflite(req.model_dir, req.output, force=req.force, verify=req.verify)


def _sequence(target: str) -> Any:
    def run(req: ExportRequest, console: Console) -> dict[str, Any]:
        from moetool.methods.gem.export import export_sequence_bundle

        return export_sequence_bundle(
            req.model_dir, req.output, target=target, quant=req.options.get("quant"), force=req.force,
            verify=req.verify, console=console,
        )  # fmt: skip

    return run


class GemPlugin(MethodPlugin):
    name = "gem"
    model_types = ("moetool_gem",)
    model_modules = ("moetool.methods.gem.model",)
    marker_files = ("gem.json",)
    export_targets = (*TOKEN_TARGETS, *(t for t in registry.TARGETS if t not in TOKEN_TARGETS))

    def _assembler(self) -> Any:
        from moetool.methods.gem.assembler import GemAssembler

        return GemAssembler()

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
        if (model_dir / "gem.json").is_file():
            target = target or "gguf"
            if target not in registry.TARGETS:
                raise self.refuse_target(model_dir, target)
            return FunctionExporter(
                name=target,
                requires=registry.TARGETS[target],
                description=f"sequence-level GEM: router.onnx + one {target} artifact per pathway + gem-manifest.json",
                fn=_sequence(target),
            )
        target = target or "onnx"
        if target == "onnx":
            return FunctionExporter("onnx", "onnx", "token-level GEM: one ONNX graph, router and τ inside", _token_onnx)
        if target == "tflite":
            return FunctionExporter("tflite", "tflite", "token-level GEM: one TFLite graph (fp32)", _token_tflite)
        raise ExportError(
            f"{model_dir} is a token-level gem model: --target {target!r} is not supported (supported: onnx, tflite)"
        )
