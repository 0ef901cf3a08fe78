"""What the graph exporters (ONNX, TFLite, Core ML, ExecuTorch) share: the plan over ExportLM parameters, the
optional-dependency check and the manifest."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from moetool.export.base import ExportError, ExportRequest
from moetool.export.graph.model import ExportLM
from moetool.export.graph.names import plan_entries
from moetool.export.graph.precision import graph_precision
from moetool.export.planning import ArtifactPlan, choose_plan, manifest_base
from moetool.io.budget import Need, human
from moetool.io.checkpoint import Checkpoint
from moetool.io.jsontypes import JsonObject


class GraphPlan(ArtifactPlan):
    def precisions(self) -> dict[str, str]:
        """Export parameter name → fp32 | int8 | int4."""
        return {str(a.entry.out_name): graph_precision(a.type) for a in self.quant.assignments}


def onnx_export(
    module: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    path: Path,
    *,
    inputs: list[str],
    outputs: list[str],
    dynamic_shapes: Any,
    custom_translation_table: dict[Callable[..., object], Callable[..., object]] | None = None,
) -> None:
    """Trace ``module`` on ``args`` to ONNX at ``path`` the way every moetool graph is traced: the dynamo exporter
    (symbolic shapes from ``dynamic_shapes``), graph optimisation on, trace metadata (module scopes) kept for
    quantization, nothing printed."""
    torch.onnx.export(
        module,
        args,
        str(path),
        dynamo=True,
        optimize=True,
        verbose=False,
        input_names=inputs,
        output_names=outputs,
        dynamic_shapes=dynamic_shapes,
        custom_translation_table=custom_translation_table,
    )


def meta_export_model(config: Mapping[str, Any]) -> ExportLM:
    """An ExportLM on the meta device: its parameter names and shapes, no weights read; float32, as graphs compute."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        try:
            return ExportLM(hf)
        except ValueError as exc:
            raise ExportError(str(exc)) from None


def plan_graph(req: ExportRequest, fmt: str) -> GraphPlan:
    cfg = Checkpoint(req.model_dir).config
    entries = plan_entries(meta_export_model(cfg))
    c = choose_plan(req, entries, cfg, fmt, precision_of=graph_precision, fit_rows=False)
    return GraphPlan(**c.plan_fields(req, cfg))


def graph_need(target: str, plan: GraphPlan, multiple: float, measured: bool, output: Path) -> Need:
    """Peak memory of a graph export as ``multiple`` × the model's float32 weights, and its artifact on disk.

    ``measured``: the multiple is a peak RSS measured at q8_0 on the real demo MoE (README), not a guess. The
    targets that trace the whole model use it; ONNX streams and estimates its own (``onnx.exporter.onnx_need``).
    """
    f32 = plan.quant.total_params * 4
    how = "as measured on the real MoE" if measured else "estimated"
    return Need(
        stage=f"{target} export",
        memory=int(f32 * multiple) + (512 << 20),
        memory_detail=f"{multiple:g}× the float32 weights ({human(f32)}), {how}",
        disk=plan.quant.total_bytes,
        output=output,
        way_out="Export to GGUF (written one tensor at a time), or on a machine with more memory",
    )


def graph_manifest(
    target: str, plan: GraphPlan, files: dict[str, Path], main: str, notes: Sequence[str] = ()
) -> JsonObject:
    """:func:`moetool.export.planning.manifest_base` plus the fp32/int8/int4 counts the graph runtime stores, and the
    target's conversion ``notes`` after the plan's."""
    manifest = manifest_base(target, plan, files, main)
    manifest["plan"]["graph_precisions"] = dict(Counter(plan.precisions().values()))
    if notes:
        manifest["notes"] = manifest["notes"] + list(notes)
    doc: JsonObject = manifest
    return doc
