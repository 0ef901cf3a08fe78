"""The steps every graph exporter (ONNX, ExecuTorch, Core ML) takes around its own conversion: the plan, the parity
run in the target's runtime, and the manifest written last into the artifact folder.

Each exporter keeps what is its own (tracing, quantization, the runtime's prefill and decode calls); this module
holds the skeleton so the three cannot drift apart in what a manifest or a parity report holds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from torch import nn

from moetool.export.base import ExportRequest, write_manifest
from moetool.export.graph.common import GraphPlan, graph_manifest, graph_need, plan_graph
from moetool.export.graph.model import load_export_model
from moetool.export.graph.parity import Batch, Decode, Prefill, judge, measure_graph
from moetool.export.heldout import held_out_text
from moetool.export.parity import ParityRecord
from moetool.extras import require
from moetool.io.budget import Need
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.progress import Step, step_printer

if TYPE_CHECKING:
    from moetool.export.graph.model import ExportLM
    from moetool.export.reference import GraphReference

__all__ = ["GraphExporter", "finish_graph_manifest", "is_float_plan", "reference_parity", "runtime_parity"]


class GraphExporter:
    """Base of the graph targets. The plan is the graph plan for the target's own name (its format in the device
    profiles); :meth:`export` checks the runtime is installed and the options valid before the model is loaded, then
    hands the loaded model to the target's :meth:`write`."""

    name: str
    requires: str  # the pip extra that provides the runtime used for verification
    runtime_modules: tuple[str, ...] = ()  # what that extra installs and the target imports
    default_quant = "f32"  # graph runtimes store fp32, int8 or int4 weights; fp32 is the exact one
    # peak RSS as a multiple of the float32 weights (measured at q8_0 where ``peak_measured``; each target sets its own)
    peak_multiple: float = 3.0
    peak_measured: bool = False

    def plan(self, req: ExportRequest) -> GraphPlan:
        return plan_graph(req, self.name)

    def export(self, req: ExportRequest, plan: GraphPlan, console: Console | None = None) -> JsonObject:
        self.ready(req, plan)
        started = time.perf_counter()
        step = step_printer(console, started)
        step(f"loading {req.model_dir}")
        hf, em = load_export_model(req.model_dir)
        return self.write(req, plan, hf, em, started=started, step=step)

    def ready(self, req: ExportRequest, plan: GraphPlan) -> None:
        """Refuse, before anything is loaded or written: a runtime that is not installed, an option the target
        cannot take (:meth:`check`), a need larger than the memory or disk available (:meth:`need`).

        Raises:
            MissingExtraError, ExportError, BudgetError: naming what is missing, wrong or too large.
        """
        for module in self.runtime_modules:
            require(module, self.requires, why=f"--target {self.name}")
        self.check(req)
        self.need(req, plan).check()

    def check(self, req: ExportRequest) -> None:
        """Refuse target options (``req.options``) the target cannot take; nothing is loaded yet."""

    def need(self, req: ExportRequest, plan: GraphPlan) -> Need:
        """Peak memory and disk of the export: :attr:`peak_multiple` × the float32 weights, for a target that holds
        the whole model (a streaming target estimates its own)."""
        return graph_need(self.name, plan, self.peak_multiple, self.peak_measured, req.output)

    def write(
        self, req: ExportRequest, plan: GraphPlan, hf: nn.Module, em: ExportLM, *, started: float, step: Step
    ) -> JsonObject:
        """Convert ``em`` (the ExportLM around transformers model ``hf``) into ``req.output`` atomically, check it
        against ``hf`` unless ``req.verify`` is off, and return the manifest (timed from ``started``); ``step``
        announces each stage as it starts."""
        raise NotImplementedError


def is_float_plan(plan: GraphPlan) -> bool:
    """Only an all-fp32 plan is held to the parity gate; a quantized one is reported, not judged."""
    return all(p == "fp32" for p in plan.precisions().values())


def runtime_parity(
    req: ExportRequest,
    hf: nn.Module,
    wrapper: nn.Module | None,
    prefill: Prefill | None,
    decode: Decode | None,
    *,
    runtime: str,
    gate_as: str | None,
    seq_lens: tuple[int, ...] | None = None,
    reference: str = "transformers float32",
    batch: Batch | None = None,
) -> ParityRecord:
    """Parity of the artifact (through ``prefill``/``decode``, run in its runtime) and of the torch ``wrapper`` that
    was converted (None: a graph built without one), both against transformers ``hf`` on the model's held-out text.

    ``batch`` runs every call at once instead (:data:`moetool.export.graph.parity.Batch`). ``reference`` names
    ``hf`` in the record (:func:`moetool.export.reference.reference_label`). ``gate_as`` names the artifact in the
    error raised when it misses the fp32 gate (the record then says ``pass`` at that tolerance); None reports
    without judging (``reported``).

    Raises:
        ExportError: ``gate_as`` is given and the artifact misses the fp32 gate.
    """
    from transformers import AutoTokenizer

    text, src = held_out_text(req.model_dir, req.eval_text)
    tok = AutoTokenizer.from_pretrained(str(req.model_dir))
    lens = seq_lens if seq_lens is not None else (32, 128)
    measured = measure_graph(
        hf, wrapper, tok, text, prefill, decode, runtime=runtime, seq_lens=lens, reference=reference, batch=batch
    )
    record = replace(measured, text=src)
    return judge(record, gate_as) if gate_as is not None else record.judged(None)


def reference_parity(
    req: ExportRequest,
    ref: GraphReference,
    batch: Batch,
    *,
    runtime: str,
    gate_as: str | None,
    seq_lens: tuple[int, ...] | None = None,
) -> ParityRecord:
    """:func:`runtime_parity` of a chunked or streamed graph target: every call through ``batch`` against the
    transformers reference ``ref`` (:func:`moetool.export.reference.graph_reference`), and, where ``ref`` is held in
    float32, the whole float ExportLM over its weights as the conversion's own figure."""
    from moetool.export.graph.model import ExportLM

    wrapper = ExportLM(ref.model).eval() if ref.held else None
    return runtime_parity(
        req, ref.model, wrapper, None, None, runtime=runtime, gate_as=gate_as, seq_lens=seq_lens,
        reference=ref.label, batch=batch,
    )  # fmt: skip


def finish_graph_manifest(
    out_dir: Path,
    target: str,
    plan: GraphPlan,
    files: dict[str, Path],
    main: str,
    fields: Mapping[str, JsonValue],
    *,
    parity: ParityRecord | str,
    started: float,
    notes: list[str] | None = None,
) -> JsonObject:
    """Write the manifest into ``out_dir`` and return it: the common fields, the target's ``fields``, its conversion
    ``notes`` after the plan's, then parity and the time since ``started`` (``time.perf_counter``) last."""
    manifest = graph_manifest(target, plan, files, main, notes or ())
    manifest |= fields
    manifest |= {
        "parity": parity.to_json() if isinstance(parity, ParityRecord) else parity,
        "timing_s": {"total": round(time.perf_counter() - started, 3)},
    }
    write_manifest(out_dir, manifest)
    return manifest
