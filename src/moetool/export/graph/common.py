"""What the graph exporters (ONNX, TFLite, Core ML, ExecuTorch) share: the plan over ExportLM parameters, loading,
held-out text and the manifest skeleton."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetool import __version__
from moetool.card import sha256_file
from moetool.export.base import ExportError, ExportRequest
from moetool.export.graph.names import plan_entries
from moetool.export.graph.precision import graph_precision
from moetool.export.planning import choose_plan
from moetool.io.checkpoint import Checkpoint
from moetool.quant.devices import MemoryEstimate
from moetool.quant.plan import QuantPlan


@dataclass
class GraphPlan:
    model_dir: Path
    config: dict[str, Any]
    quant: QuantPlan
    name: str
    device: str | None = None
    memory: MemoryEstimate | None = None
    context: int = 2048
    candidates: list[tuple[str, int, bool]] = field(default_factory=list)

    def precisions(self) -> dict[str, str]:
        """Export parameter name → fp32 | int8 | int4."""
        return {str(a.entry.out_name): graph_precision(a.type) for a in self.quant.assignments}


def require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExportError(f"this target needs {module}: pip install 'moetool[{extra}]' (or setup.sh --{extra})") from None


def meta_export_model(config: dict[str, Any]) -> Any:
    """An ExportLM on the meta device: its parameter names and shapes, no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moetool.export.graph.model import ExportLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
        try:
            return ExportLM(hf)
        except ValueError as exc:
            raise ExportError(str(exc)) from None


def plan_graph(req: ExportRequest, fmt: str) -> GraphPlan:
    from moetool.export.gguf.exporter import model_name

    cfg = Checkpoint(req.model_dir).config
    entries = plan_entries(meta_export_model(cfg))
    c = choose_plan(req, entries, cfg, fmt, precision_of=graph_precision, fit_rows=False)
    return GraphPlan(req.model_dir, cfg, c.quant, model_name(req.model_dir), c.device, c.memory, c.context, c.candidates)


def manifest_base(target: str, plan: GraphPlan, files: dict[str, Path], main: str) -> dict[str, Any]:
    return {
        "format": "moetool-artifact/1",
        "target": target,
        "file": main,
        "files": {n: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for n, p in files.items()},
        "model": {
            "name": plan.name,
            "path": str(plan.model_dir),
            "model_type": plan.config.get("model_type"),
            "weights_sha256": {f.name: sha256_file(f) for f in Checkpoint(plan.model_dir).weight_files},
        },
        "artifact": {"bytes": sum(p.stat().st_size for p in files.values()), "sha256": sha256_file(files[main])},
        "device": plan.device,
        "memory_estimate": None
        if plan.memory is None
        else {
            "context": plan.context,
            "weights": plan.memory.weights,
            "kv_cache": plan.memory.kv_cache,
            "runtime": plan.memory.runtime,
            "total": plan.memory.total,
        },
        "plan": plan.quant.to_json() | {"graph_precisions": _count(plan.precisions())},
        "notes": plan.quant.notes(),
        "moetool": __version__,
    }


def _count(p: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in p.values():
        out[v] = out.get(v, 0) + 1
    return out


def dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
