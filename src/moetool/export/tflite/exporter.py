"""``moetool export --target tflite``: ExportLM with a static KV cache → one ``.tflite`` with ``prefill`` and
``decode`` signatures (litert-torch), int8/int4 by role through ai-edge-quantizer, parity in the LiteRT interpreter.

The conversion runs in litert-torch's own interpreter through :mod:`moetool.export.tflite.runner`
(worker: :mod:`moetool.export.tflite.worker`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from rich.console import Console

from moetool.export.base import ExportError, ExportRequest, write_manifest
from moetool.export.graph.common import GraphPlan, graph_manifest, graph_need, plan_graph
from moetool.export.graph.parity import judge
from moetool.export.heldout import held_out_text
from moetool.export.parity import NOT_VERIFIED, ParityRecord, parity_of
from moetool.export.pipeline_steps import is_float_plan
from moetool.export.tflite.runner import REPO, litert_python, run_worker
from moetool.export.tflite.worker import role_precisions
from moetool.io.atomic import atomic_dir
from moetool.progress import step_printer

__all__ = ["REPO", "TFLiteExporter", "litert_python"]  # REPO, litert_python: kept importable here for older callers


class TFLiteExporter:
    name = "tflite"
    requires = "tflite"
    default_quant = "f32"
    peak_multiple, peak_measured = 6.7, True  # 8.6 GB for the 1.29 GB (float32) real MoE

    def plan(self, req: ExportRequest) -> GraphPlan:
        plan = plan_graph(req, "tflite")

        try:
            role_precisions(plan.precisions())
        except ValueError as exc:
            raise ExportError(str(exc)) from None
        return plan

    def export(self, req: ExportRequest, plan: GraphPlan, console: Console | None = None) -> dict[str, Any]:

        litert_python()  # no litert-torch: refuse before anything is written
        graph_need(self.name, plan, self.peak_multiple, self.peak_measured, req.output).check()
        max_pos = int(plan.config.get("max_position_embeddings", 2048))
        capacity = min(max_pos, plan.context, 512)
        prefill_len = min(128, capacity - 8)
        text, src = held_out_text(req.model_dir, req.eval_text)
        t0 = time.perf_counter()
        step = step_printer(console, t0)
        with atomic_dir(req.output, force=req.force) as tmp:
            request = {
                "model_dir": str(req.model_dir),
                "out_dir": str(tmp),
                "precisions": plan.precisions(),
                "capacity": capacity,
                "prefill_len": prefill_len,
                "verify": req.verify,
                "eval_text": text,
            }
            checked = ", then checking it in the LiteRT interpreter" if req.verify else ""
            step(f"converting with litert-torch in its own interpreter{checked}")
            result = run_worker("moetool.export.tflite.worker", request)
            # the worker's figures come back as JSON (it runs in its own interpreter)
            parity = parity_of(result.pop("parity", NOT_VERIFIED)) or NOT_VERIFIED
            if isinstance(parity, ParityRecord):
                parity = replace(parity, text=src)
                parity = judge(parity, "TFLite (fp32)") if is_float_plan(plan) else parity.judged(None)
            path = tmp / "model.tflite"
            manifest = graph_manifest("tflite", plan, {"model.tflite": path}, "model.tflite")
            manifest |= {
                "runtime": "LiteRT (ai_edge_litert interpreter, XNNPACK)",
                "signatures": {"prefill": f"{prefill_len} tokens (right-padded)", "decode": "1 token"},
                "kv_cache": f"explicit inputs/outputs, capacity {capacity}",
                **result,
                "parity": parity.to_json() if isinstance(parity, ParityRecord) else parity,
                "timing_s": {"total": round(time.perf_counter() - t0, 3)},
            }
            write_manifest(tmp, manifest)
        return manifest
