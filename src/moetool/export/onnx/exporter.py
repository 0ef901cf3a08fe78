"""``moetool export --target onnx``: ExportLM → one decoder graph in the convention ONNX LLM runners drive
(:mod:`moetool.export.onnx.decoder`), weights quantized per the plan (:mod:`moetool.export.onnx.quantize`), parity
in onnxruntime, and greedy generation in onnxruntime-genai from the written folder.

Files: ``model.onnx`` (``model.onnx.data`` beside it past protobuf's 2 GB), ``genai_config.json``, the model's
tokenizer and config files.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moetool.export.base import NOT_VERIFIED, ExportError, ExportRequest
from moetool.export.graph.common import GraphPlan
from moetool.export.heldout import held_out_text
from moetool.export.onnx.decoder import SCOPE, export_decoder, name_dims, write_runner_files
from moetool.export.onnx.moe_op import to_qmoe, translation_table
from moetool.export.onnx.quantize import quantize_graph
from moetool.export.onnx.runner import genai_check, ort_runners, ort_session
from moetool.export.parity import ParityRecord
from moetool.export.pipeline_steps import GraphExporter, finish_graph_manifest, is_float_plan, runtime_parity
from moetool.io.atomic import atomic_dir
from moetool.io.jsontypes import JsonObject
from moetool.progress import Step

if TYPE_CHECKING:
    from onnx import ModelProto
    from torch import nn

    from moetool.export.graph.model import ExportLM


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


class ONNXExporter(GraphExporter):
    # 6.44 GB for the 135M-shaped ladder rung's MoE (0.75 GB in bf16, 1.5 GB in float32) at q8_0; 8.06 GB (5.4×)
    # while the export model held its own copy of the weights
    peak_multiple, peak_measured = 4.3, True
    name = "onnx"
    requires = "onnx"
    runtime_modules = ("onnx", "onnxscript", "onnxruntime")  # onnxscript: torch.onnx's dynamo exporter

    def check(self, req: ExportRequest) -> None:
        moe_kernel(req)

    def write(
        self, req: ExportRequest, plan: GraphPlan, hf: nn.Module, em: ExportLM, *, started: float, step: Step
    ) -> JsonObject:
        import onnxruntime as ort

        precisions = plan.precisions()
        sparse = moe_kernel(req) == "sparse" and em.make_sparse() > 0
        qmoe: dict[str, int] = {}

        def before_quantizing(model: ModelProto) -> list[str]:
            name_dims(model)
            if not sparse:
                return []
            done, notes = to_qmoe(model, precisions, SCOPE)
            qmoe.update(done)
            return notes

        with atomic_dir(req.output, force=req.force) as tmp:
            path = tmp / "model.onnx"
            step("torch.onnx.export: one decoder graph for prefill and decode")
            export_decoder(em, path, translation_table() if sparse else None)
            if not is_float_plan(plan):
                step("quantizing the graph")
            counts, qnotes = quantize_graph(path, precisions, SCOPE, before=before_quantizing)
            context = min(plan.context, int(plan.config.get("max_position_embeddings", plan.context)))
            side = write_runner_files(req.model_dir, tmp, em, path.name, context)
            parity: ParityRecord | str = NOT_VERIFIED
            generation: JsonObject | str = NOT_VERIFIED
            if req.verify:
                step("checking the graph in onnxruntime against transformers")
                prefill, decode = ort_runners(ort_session(path), em.n_layers, em.n_kv, em.head_dim)
                runtime = f"onnxruntime {ort.__version__}"
                gate_as = "ONNX (fp32)" if is_float_plan(plan) else None
                parity = runtime_parity(req, hf, em, prefill, decode, runtime=runtime, gate_as=gate_as)
                generation = genai_check(tmp, hf, _genai_prompt(req)) or "onnxruntime-genai not installed"
            files = {p.name: p for p in sorted(tmp.iterdir()) if p.is_file()}
            fields: JsonObject = {
                "runtime": f"onnxruntime {ort.__version__}",
                "interface": {
                    "graph": path.name,
                    "inputs": "input_ids, attention_mask (int64 [batch, past + new]), position_ids, "
                    "past_key_values.{i}.key|value (empty for the prefill)",
                    "outputs": "logits, present.{i}.key|value",
                    "runner_files": [*side],
                },
                "quantized_nodes": {**counts},
                "moe_kernel": {
                    "kind": "sparse" if sparse else "dense-masked",
                    "op": ("QMoE" if any(qmoe.values()) else "MoE") + " (com.microsoft, onnxruntime only)"
                    if sparse
                    else "every expert as standard MatMuls, unchosen ones weighted 0 (any ONNX runtime)",
                    "layers": em.sparse_moe_layers(),
                    "experts_quantized": {**qmoe},
                },
                "ops": {**_count_ops(path)},
                "generation": generation,
            }
            manifest = finish_graph_manifest(
                tmp, "onnx", plan, files, "model.onnx", fields, parity=parity, started=started, notes=qnotes
            )
        return manifest
