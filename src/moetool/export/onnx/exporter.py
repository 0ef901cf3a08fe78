"""``moetool export --target onnx``: ExportLM → a prefill graph and a decode-step graph (dynamo exporter), weights
quantized per the plan with onnxruntime's MatMulNBits (experts included: they are 2-D MatMuls in ExportLM), parity
in onnxruntime.

Files: ``model.onnx`` (prefill: input_ids, position_ids, mask [1,1,T,T] → logits, present.N.key/value) and
``model-with-past.onnx`` (one token: input_ids [1,1], position_ids [1,1], mask [1,1,1,P+1], past.N.key/value
[1, kv_heads, P, head_dim] → logits, present.N.key/value with P+1 positions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetool.export.base import NOT_VERIFIED, ExportRequest
from moetool.export.graph.common import GraphPlan, onnx_export
from moetool.export.graph.model import causal_mask, prefill_inputs
from moetool.export.graph.parity import Decode, Prefill
from moetool.export.pipeline_steps import GraphExporter, finish_graph_manifest, is_float_plan, runtime_parity
from moetool.io.atomic import atomic_dir

BLOCK = 32


def _names(n_layers: int, kind: str) -> list[str]:
    return [f"{kind}.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def export_graphs(model: Any, prefill_path: Path, decode_path: Path) -> None:
    """Trace both graphs with torch.onnx (dynamo); the sequence and past lengths stay dynamic."""

    n = model.n_layers
    seq = torch.export.Dim("seq", min=2, max=4096)
    ids = torch.randint(0, 10, (1, 8))
    onnx_export(
        model,
        prefill_inputs(ids),
        prefill_path,
        inputs=["input_ids", "position_ids", "mask"],
        outputs=["logits", *_names(n, "present")],
        dynamic_shapes=({1: seq}, {1: seq}, {2: seq, 3: seq}),
    )
    past_len = torch.export.Dim("past", min=1, max=4095)
    p = 5
    past = [torch.zeros(1, model.n_kv, p, model.head_dim) for _ in range(2 * n)]
    args = (ids[:, :1], torch.tensor([[p]]), causal_mask(1, p), *past)
    shapes = (None, None, {3: past_len + 1}, tuple({2: past_len} for _ in past))  # *past is one input
    onnx_export(
        model,
        args,
        decode_path,
        inputs=["input_ids", "position_ids", "mask", *_names(n, "past")],
        outputs=["logits", *_names(n, "present")],
        dynamic_shapes=shapes,
    )


def _module_of(node: Any) -> str | None:
    """The ExportLM module a node was traced from (the dynamo exporter records its name scopes)."""
    import ast

    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = ast.literal_eval(prop.value)
            return str(scopes[-2]) if len(scopes) >= 2 else None
    return None


def quantize_graph(path: Path, precisions: dict[str, str]) -> tuple[dict[str, int], list[str]]:
    """Quantize MatMul/Gather weights in place per the plan.

    Returns nodes quantized per precision, and notes on planned nodes onnxruntime left in fp32 (its quantizer
    handles Gather, i.e. the embedding table, only at 4 bits).
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(path))
    groups: dict[str, list[str]] = {"int8": [], "int4": []}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gather"):
            continue
        module = _module_of(node)
        p = precisions.get(f"{module}.weight") if module else None
        if p in groups:
            groups[p].append(node.name)
    for bits, key in ((4, "int4"), (8, "int8")):
        if groups[key]:
            # nodes_to_include only adds to op_types_to_quantize; exclusion is what restricts a pass
            others = [
                n.name for n in model.graph.node if n.op_type in ("MatMul", "Gather") and n.name not in groups[key]
            ]
            q = MatMulNBitsQuantizer(
                model,
                bits=bits,
                block_size=BLOCK,
                is_symmetric=True,
                nodes_to_exclude=others,
                op_types_to_quantize=("MatMul", "Gather"),
            )
            q.process()
            model = q.model.model
    for node in model.graph.node:  # trace metadata (stack traces with local paths) is only needed up to here
        del node.metadata_props[:]
    save_model(model, path)
    left = {n.name for n in model.graph.node if n.op_type in ("MatMul", "Gather")}
    done = {k: len([n for n in v if n not in left]) for k, v in groups.items()}
    notes = [
        f"{n} planned {k} but left fp32 by onnxruntime's quantizer" for k, v in groups.items() for n in v if n in left
    ]
    return done, notes


def save_model(model: Any, path: Path) -> None:
    """One file when it fits protobuf's 2 GB limit, else one external-data file beside it (stale ones removed)."""
    import onnx

    for old in path.parent.glob(path.name + ".data"):
        old.unlink()
    if model.ByteSize() < 1_800_000_000:
        onnx.save(model, str(path))
    else:
        onnx.save(
            model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data"
        )


def _count_ops(path: Path) -> dict[str, int]:
    import onnx

    out: dict[str, int] = {}
    for n in onnx.load(str(path)).graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _ort_runners(ort: Any, prefill_path: Path, decode_path: Path, n_layers: int) -> tuple[Prefill, Decode]:
    """Prefill and decode-step calls into onnxruntime sessions over the two graphs, for :func:`runtime_parity`."""

    so = ort.SessionOptions()
    so.log_severity_level = 3
    s_pre = ort.InferenceSession(str(prefill_path), so, providers=["CPUExecutionProvider"])
    s_dec = ort.InferenceSession(str(decode_path), so, providers=["CPUExecutionProvider"])

    def prefill(ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        t = ids.shape[1]
        feeds = {
            "input_ids": ids,
            "position_ids": np.arange(t, dtype=np.int64)[None],
            "mask": causal_mask(t, 0).numpy(),
        }
        out = s_pre.run(None, feeds)
        return out[0], out[1:]

    def decode(ids: np.ndarray, pos: int, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {
            "input_ids": ids,
            "position_ids": np.array([[pos]], dtype=np.int64),
            "mask": causal_mask(1, pos).numpy(),
        }
        feeds |= dict(zip(_names(n_layers, "past"), past, strict=True))
        out = s_dec.run(None, feeds)
        return out[0], out[1:]

    return prefill, decode


class ONNXExporter(GraphExporter):
    name = "onnx"
    requires = "onnx"
    runtime_modules = ("onnx", "onnxscript", "onnxruntime")  # onnxscript: torch.onnx's dynamo exporter

    def write(self, req: ExportRequest, plan: GraphPlan, hf: Any, em: Any, *, started: float) -> dict[str, Any]:
        import onnxruntime as ort

        with atomic_dir(req.output, force=req.force) as tmp:
            pre, dec = tmp / "model.onnx", tmp / "model-with-past.onnx"
            export_graphs(em, pre, dec)
            counts, qnotes = quantize_graph(pre, plan.precisions())
            quantize_graph(dec, plan.precisions())
            parity: dict[str, Any] | str = NOT_VERIFIED
            if req.verify:
                prefill, decode = _ort_runners(ort, pre, dec, em.n_layers)
                runtime = f"onnxruntime {ort.__version__}"
                gate_as = "ONNX (fp32)" if is_float_plan(plan) else None
                parity = runtime_parity(req, hf, em, prefill, decode, runtime=runtime, gate_as=gate_as)
            fields = {
                "runtime": f"onnxruntime {ort.__version__}",
                "graphs": {"prefill": "model.onnx", "decode_step": "model-with-past.onnx"},
                "quantized_nodes": counts,
                "ops": _count_ops(pre),
            }
            files = {"model.onnx": pre, "model-with-past.onnx": dec}
            manifest = finish_graph_manifest(
                tmp, "onnx", plan, files, "model.onnx", fields, parity=parity, started=started, notes=qnotes
            )
        return manifest
