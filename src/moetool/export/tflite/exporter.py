"""``moetool export --target tflite``: ExportLM with a static KV cache → one ``.tflite`` with ``prefill`` and
``decode`` signatures (litert-torch), int8/int4 by role through ai-edge-quantizer, parity in the LiteRT interpreter.

litert-torch pins typing-extensions and pydantic below what onnx/executorch tooling here needs, so it lives in its
own venv (``bash scripts/setup.sh --tflite`` makes ``.venv-litert``) and the conversion runs there as a subprocess;
if litert-torch is importable in the current interpreter that one is used instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moetool.export.base import ExportError, ExportRequest, write_manifest
from moetool.export.graph.common import GraphPlan, graph_manifest, plan_graph
from moetool.export.graph.parity import gate
from moetool.io.atomic import atomic_dir

REPO = Path(__file__).resolve().parents[4]


def litert_python() -> str:
    env = os.environ.get("MOETOOL_LITERT_PYTHON")
    if env:
        return env
    if importlib.util.find_spec("litert_torch") is not None:
        return sys.executable
    venv = REPO / ".venv-litert" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    raise ExportError(
        "TFLite export needs litert-torch, kept in its own venv: bash scripts/setup.sh --tflite (makes .venv-litert), "
        "or set MOETOOL_LITERT_PYTHON to a python that has it"
    )


class TFLiteExporter:
    name = "tflite"
    requires = "tflite"

    def plan(self, req: ExportRequest) -> GraphPlan:
        plan = plan_graph(req, "tflite")
        from moetool.export.tflite.worker import role_precisions

        try:
            role_precisions(plan.precisions())
        except ValueError as exc:
            raise ExportError(str(exc)) from None
        return plan

    def export(self, req: ExportRequest, plan: GraphPlan, console: Any = None) -> dict[str, Any]:
        from moetool.export.heldout import held_out_text

        py = litert_python()
        max_pos = int(plan.config.get("max_position_embeddings", 2048))
        capacity = min(max_pos, plan.context, 512)
        prefill_len = min(128, capacity - 8)
        text, src = held_out_text(req.model_dir, req.eval_text)
        t0 = time.perf_counter()
        with atomic_dir(req.output, force=req.force) as tmp, tempfile.TemporaryDirectory() as work:
            request = {
                "model_dir": str(req.model_dir),
                "out_dir": str(tmp),
                "precisions": plan.precisions(),
                "capacity": capacity,
                "prefill_len": prefill_len,
                "verify": req.verify,
                "eval_text": text,
            }
            rp = Path(work) / "request.json"
            rp.write_text(json.dumps(request))
            proc = subprocess.run(
                [py, "-m", "moetool.export.tflite.worker", str(rp)],
                capture_output=True,
                text=True,
                env=os.environ | {"PYTHONPATH": str(REPO / "src")},
            )
            if proc.returncode != 0:
                tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
                raise ExportError(f"TFLite conversion failed in {py}:\n{tail}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            parity = result.pop("parity", "not verified (--no-verify)")
            if isinstance(parity, dict):
                parity["text"] = src
                if all(p == "fp32" for p in plan.precisions().values()):
                    gate(parity, "TFLite (fp32)")
            path = tmp / "model.tflite"
            manifest = graph_manifest("tflite", plan, {"model.tflite": path}, "model.tflite")
            manifest |= {
                "runtime": "LiteRT (ai_edge_litert interpreter, XNNPACK)",
                "signatures": {"prefill": f"{prefill_len} tokens (right-padded)", "decode": "1 token"},
                "kv_cache": f"explicit inputs/outputs, capacity {capacity}",
                **result,
                "parity": parity,
                "timing_s": {"total": round(time.perf_counter() - t0, 3)},
            }
            write_manifest(tmp, manifest)
        return manifest
