"""``moetool export --target onnx``: one decoder graph in the convention ONNX LLM runners drive
(:mod:`moetool.export.onnx.decoder`), traced without weights (:mod:`moetool.export.onnx.structure`), its weights
stored as the plan says (:mod:`moetool.export.onnx.layout`) and written one layer at a time from the checkpoint
(:mod:`moetool.export.onnx.weights`); parity in onnxruntime against transformers (streamed from disk when the model
does not fit), and greedy generation in onnxruntime-genai from the written folder.

Files: ``model.onnx`` (the graph), ``model.onnx.data`` (its weights), ``genai_config.json``, the model's tokenizer
and config files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from moetool.arch.outputs import expert_count
from moetool.export.base import NOT_VERIFIED, ExportError, ExportRequest
from moetool.export.graph.common import GraphPlan
from moetool.export.heldout import held_out_text
from moetool.export.onnx.decoder import write_runner_files
from moetool.export.onnx.layout import Layout, lay_out
from moetool.export.onnx.runner import genai_check, ort_runners, ort_session
from moetool.export.onnx.structure import Structure, trace_structure
from moetool.export.onnx.weights import DATA_FILE, save_structure, write_weights
from moetool.export.parity import ParityRecord
from moetool.export.pipeline_steps import GraphExporter, finish_graph_manifest, is_float_plan, runtime_parity
from moetool.io.atomic import atomic_dir
from moetool.io.budget import Need, human
from moetool.io.jsontypes import JsonObject
from moetool.progress import Step, step_printer

if TYPE_CHECKING:
    from rich.console import Console


def _count_ops(path: Path) -> dict[str, int]:
    import onnx

    out: dict[str, int] = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _genai_prompt(req: ExportRequest, n: int = 16) -> list[int]:
    from transformers import AutoTokenizer

    text, _ = held_out_text(req.model_dir, req.eval_text)
    ids: list[int] = AutoTokenizer.from_pretrained(str(req.model_dir))(text[:2000])["input_ids"]
    return ids[:n]


MOE_KERNELS = ("sparse", "dense")


def moe_kernel(req: ExportRequest) -> str:
    """``--moe-kernel``: sparse (onnxruntime's MoE/QMoE: only the top-k experts run) or dense (standard ops)."""
    kind = str(req.options.get("moe_kernel") or "sparse")
    if kind not in MOE_KERNELS:
        raise ExportError(f"--moe-kernel {kind!r}: choose {' or '.join(MOE_KERNELS)}")
    return kind


def accuracy_level(req: ExportRequest) -> int:
    """``--accuracy-level``: what the 4- and 8-bit operators compute their activations in
    (:data:`moetool.export.onnx.quantize.ACCURACY_LEVELS`; default 4, int8).

    Raises:
        ExportError: a level not offered.
    """
    from moetool.export.onnx.quantize import ACCURACY_LEVEL, ACCURACY_LEVELS

    given = req.options.get("accuracy_level")
    level = ACCURACY_LEVEL if given is None else given
    if level not in ACCURACY_LEVELS:
        offered = "; ".join(f"{k}: {v}" for k, v in ACCURACY_LEVELS.items())
        raise ExportError(f"--accuracy-level {level!r}: choose {offered}")
    return int(level)


WRITE_OVERHEAD = 768 << 20  # torch, onnx and the traced structure
# onnxruntime's session over the artifact (mapped weights, the 4/8-bit ones repacked), fitted to the size ladder's
# 360M and 1.7B rungs at moe-q4: 2.55 GB and 7.73 GB measured, 2.55 GB and 8.1 GB estimated
SESSION_MULTIPLE = 1.6


def onnx_need(plan: GraphPlan, *, sparse: bool, verify: bool, output: Path) -> Need:
    """Memory and disk of a streamed ONNX export of ``plan``: writing holds the weights outside the layer stack and
    one layer in float32 (two for a sparse block: the per-expert weights and their fused stacks) while a tensor is
    rounded; verification holds onnxruntime's copy of the artifact beside the transformers reference, held in
    float32 or streamed (:func:`moetool.export.reference.graph_reference_need`: a pass of a streamed reference reads
    the checkpoint; verification makes two)."""
    from moetool.compute.upcast import layer_bytes
    from moetool.export.reference import graph_reference_need

    params, artifact = plan.quant.total_params, plan.quant.total_bytes
    outside, layer = layer_bytes(plan.config, params)
    writing = outside + layer * (5 if sparse else 3) // 2 + WRITE_OVERHEAD
    reference, held = graph_reference_need(params, plan.config)
    verifying = int(artifact * SESSION_MULTIPLE) + reference
    how = "held in float32" if held else "streamed from disk, one float32 layer at a time"
    return Need(
        stage="onnx export",
        memory=max(writing, verifying) if verify else writing,
        memory_detail=f"written one layer at a time ({human(writing)}); verified against the model {how}"
        if verify
        else "written one layer at a time",
        disk=artifact,
        output=output,
        way_out="Export with --no-verify, or on a machine with more memory",
    )


class ONNXExporter(GraphExporter):
    """Streamed: the graph is traced on ``meta`` (:mod:`moetool.export.onnx.structure`) and its weights are
    written one decoder layer at a time, rounded as they are written (:mod:`moetool.export.onnx.weights`); the
    model is never held whole."""

    name = "onnx"
    requires = "onnx"
    runtime_modules = ("onnx", "onnxscript", "onnxruntime")  # onnxscript: torch.onnx's dynamo exporter

    def check(self, req: ExportRequest) -> None:
        moe_kernel(req)
        accuracy_level(req)

    def need(self, req: ExportRequest, plan: GraphPlan) -> Need:
        sparse = moe_kernel(req) == "sparse" and expert_count(plan.config) > 0
        return onnx_need(plan, sparse=sparse, verify=req.verify, output=req.output)

    def export(self, req: ExportRequest, plan: GraphPlan, console: Console | None = None) -> JsonObject:
        self.ready(req, plan)
        started = time.perf_counter()
        step = step_printer(console, started)
        step("tracing the decoder's structure on the meta device (no weights)")
        st = trace_structure(plan.config, sparse=moe_kernel(req) == "sparse")
        layout = lay_out(st, plan.precisions(), accuracy_level(req))
        with atomic_dir(req.output, force=req.force) as tmp:
            path = tmp / "model.onnx"
            step(f"writing the weights one layer at a time ({st.n_layers} layers)")
            write_weights(req.model_dir, st, layout, tmp / DATA_FILE)
            save_structure(st.model, path)
            context = min(plan.context, int(plan.config.get("max_position_embeddings", plan.context)))
            side = write_runner_files(req.model_dir, tmp, st.em, path.name, context)
            parity: ParityRecord | str = NOT_VERIFIED
            generation: JsonObject | str = NOT_VERIFIED
            if req.verify:
                parity, generation = self._verify(req, plan, st, path, step)
            files = {p.name: p for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest = finish_graph_manifest(
                tmp,
                "onnx",
                plan,
                files,
                "model.onnx",
                self._fields(path, st, layout, side, generation),
                parity=parity,
                started=started,
                notes=layout.notes,
            )
        return manifest

    def _verify(
        self, req: ExportRequest, plan: GraphPlan, st: Structure, path: Path, step: Step
    ) -> tuple[ParityRecord, JsonObject | str]:
        import onnxruntime as ort

        from moetool.export.graph.model import ExportLM
        from moetool.export.reference import graph_reference

        reference = graph_reference(req.model_dir, plan.quant.total_params, plan.config)
        ref = reference.model
        step(f"checking the graph in onnxruntime against {reference.label}")
        # over the held float32 reference the torch export model shares its weights: the conversion's own figure
        # (dense-masked: the same function as the sparse op, without a fused copy of the experts)
        wrapper = ExportLM(ref).eval() if reference.held else None
        session = ort_session(path)
        prefill, decode = ort_runners(session, st.n_layers, st.em.n_kv, st.em.head_dim)
        runtime = f"onnxruntime {ort.__version__}"
        gate_as = "ONNX (fp32)" if is_float_plan(plan) else None
        label = reference.label
        parity = runtime_parity(req, ref, wrapper, prefill, decode, runtime=runtime, gate_as=gate_as, reference=label)
        del session, prefill, decode, wrapper
        generation = genai_check(path.parent, ref, _genai_prompt(req)) or "onnxruntime-genai not installed"
        return parity, generation

    def _fields(
        self, path: Path, st: Structure, layout: Layout, side: list[str], generation: JsonObject | str
    ) -> JsonObject:
        import onnxruntime as ort

        from moetool.export.onnx.quantize import ACCURACY_LEVELS

        sparse = st.sparse_layers > 0
        return {
            "runtime": f"onnxruntime {ort.__version__}",
            "interface": {
                "graph": path.name,
                "inputs": "input_ids, attention_mask (int64 [batch, past + new]), position_ids, "
                "past_key_values.{i}.key|value (empty for the prefill)",
                "outputs": "logits, present.{i}.key|value",
                "runner_files": [*side],
            },
            "export": "streamed: the graph traced on the meta device, the weights written one layer at a time",
            "quantized_nodes": {**layout.counts},
            "accuracy_level": {"level": layout.accuracy_level, "activations": ACCURACY_LEVELS[layout.accuracy_level]},
            "moe_kernel": {
                "kind": "sparse" if sparse else "dense-masked",
                "op": ("QMoE" if any(layout.experts.values()) else "MoE") + " (com.microsoft, onnxruntime only)"
                if sparse
                else "every expert as standard MatMuls, unchosen ones weighted 0 (any ONNX runtime)",
                "layers": st.sparse_layers,
                "experts_quantized": {**layout.experts},
            },
            "ops": {**_count_ops(path)},
            "generation": generation,
        }
