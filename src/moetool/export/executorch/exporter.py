"""``moetool export --target executorch``: ExportLM → one ``.pte`` with two methods, ``forward`` (prefill, dynamic
length) and ``decode`` (one token against a KV cache of dynamic length), lowered to XNNPACK; parity through
``executorch.runtime``. Weights are quantized per the plan with torchao before export (int8 or int4 groupwise,
dynamic int8 activations: the forms XNNPACK runs), by module name, so the router and norms stay fp32."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from torch.export import ExportedProgram

from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetool.export.base import NOT_VERIFIED, ExportRequest
from moetool.export.graph.common import GraphPlan
from moetool.export.graph.model import ExportLM, causal_mask, prefill_inputs
from moetool.export.graph.moe_kernel import dense_moe_kernel
from moetool.export.graph.parity import Decode, Prefill
from moetool.export.parity import ParityRecord
from moetool.export.pipeline_steps import GraphExporter, finish_graph_manifest, is_float_plan, runtime_parity
from moetool.io.atomic import atomic_dir
from moetool.io.jsontypes import JsonObject
from moetool.progress import Step


def export_programs(model: ExportLM) -> tuple[ExportedProgram, ExportedProgram]:
    """torch.export both methods (strict tracing: the non-strict path adds stride guards it then rejects)."""

    seq = torch.export.Dim("seq", min=2, max=4096)
    pre = torch.export.export(
        model,
        prefill_inputs(torch.randint(0, 10, (1, 8))),
        dynamic_shapes=({1: seq}, {1: seq}, {2: seq, 3: seq}),
        strict=True,
    )
    past_len = torch.export.Dim("past", min=1, max=4095)
    p = 5
    past = [torch.zeros(1, model.n_kv, p, model.head_dim) for _ in range(2 * model.n_layers)]
    dec = torch.export.export(
        model,
        (torch.tensor([[1]]), torch.tensor([[p]]), causal_mask(1, p), *past),
        dynamic_shapes=(None, None, {3: past_len + 1}, tuple({2: past_len} for _ in past)),
        strict=True,
    )
    return pre, dec


def quantize_modules(model: nn.Module, precisions: dict[str, str]) -> tuple[dict[str, int], list[str]]:
    """torchao weight quantization of the Linear modules the plan puts at int8/int4; returns counts and notes.

    int4 groups are 32 wide; a layer whose input width is not a multiple of 32 gets int8 instead (with a note).
    """
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    counts = {"int8": 0, "int4": 0}
    notes: list[str] = []
    by_cfg: dict[tuple[str, int], set[str]] = {}
    for name, p in precisions.items():
        mod = name.removesuffix(".weight")
        if p == "fp32" or mod not in linears:
            continue
        if p == "int8":
            by_cfg.setdefault(("int8", 0), set()).add(mod)
            continue
        k = linears[mod].in_features
        if k % 32:  # XNNPACK's 4-bit kernels take groups of 32 only
            notes.append(f"{mod}: input width {k} is not a multiple of 32 (XNNPACK's int4 group); int8 instead")
            by_cfg.setdefault(("int8", 0), set()).add(mod)
            continue
        by_cfg.setdefault(("int4", 32), set()).add(mod)
    for (key, group), names in by_cfg.items():
        # XNNPACK runs 4-bit weights groupwise and 8-bit weights per output channel
        dtype = getattr(torch, "int4") if key == "int4" else torch.int8  # noqa: B009 (int4 is not in the stubs)
        gran = PerGroup(group) if key == "int4" else PerAxis(0)
        cfg = Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=gran)
        quantize_(model, cfg, filter_fn=lambda m, fqn, names=names: fqn in names)
        counts[key] += len(names)
    return counts, notes


def lower(model: ExportLM, step: Step | None = None) -> bytes:
    """Both methods of ``model`` lowered to XNNPACK: the ``.pte`` program's bytes."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    step = step or (lambda what: None)
    step("torch.export: the prefill and decode methods")
    pre, dec = export_programs(model)
    step(f"lowering {len(pre.graph.nodes) + len(dec.graph.nodes):,} graph nodes to XNNPACK (the slow step)")
    prog = to_edge_transform_and_lower({"forward": pre, "decode": dec}, partitioner=[XnnpackPartitioner()])
    step("serializing the program")
    buffer: bytes = prog.to_executorch().buffer
    return buffer


def _pte_runners(path: Path) -> tuple[Prefill, Decode]:
    """Prefill and decode calls into the program's two methods through ``executorch.runtime``."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(path))
    fwd, step = program.load_method("forward"), program.load_method("decode")

    def prefill(ids: np.ndarray) -> tuple[np.ndarray, list[Any]]:
        out = fwd.execute(list(prefill_inputs(torch.from_numpy(ids))))
        return out[0].numpy(), list(out[1:])

    def decode(ids: np.ndarray, pos: int, past: list[Any]) -> tuple[np.ndarray, list[Any]]:
        out = step.execute([torch.from_numpy(ids), torch.tensor([[pos]]), causal_mask(1, pos), *past])
        return out[0].numpy(), list(out[1:])

    return prefill, decode


class ExecuTorchExporter(GraphExporter):
    peak_multiple, peak_measured = 12.2, True  # 15.7 GB for the 1.29 GB (float32) real MoE
    name = "executorch"
    requires = "executorch"
    runtime_modules = ("executorch",)

    def write(
        self, req: ExportRequest, plan: GraphPlan, hf: nn.Module, em: ExportLM, *, started: float, step: Step
    ) -> JsonObject:

        if not is_float_plan(plan):
            step("quantizing the linear layers with torchao")
        counts, qnotes = quantize_modules(em, plan.precisions())
        buf = lower(em, step)
        with atomic_dir(req.output, force=req.force) as tmp:
            path = tmp / "model.pte"
            path.write_bytes(buf)
            parity: ParityRecord | str = NOT_VERIFIED
            if req.verify:
                step("checking the program in executorch.runtime against transformers")
                prefill, decode = _pte_runners(path)
                ref_model = ExportLM(hf).eval()  # em was quantized in place; the wrapper figure is for the float one
                gate_as = "ExecuTorch (fp32)" if is_float_plan(plan) else None
                runtime = "executorch (XNNPACK)"
                parity = runtime_parity(req, hf, ref_model, prefill, decode, runtime=runtime, gate_as=gate_as)
            fields: JsonObject = {
                "runtime": "executorch.runtime, XNNPACK delegate",
                "methods": {"forward": "prefill", "decode": "one token with KV cache"},
                "quantized_linears": {**counts},
                "moe_kernel": dense_moe_kernel("executorch", em.moe_layers()),
            }
            files = {"model.pte": path}
            manifest = finish_graph_manifest(
                tmp, "executorch", plan, files, "model.pte", fields, parity=parity, started=started, notes=qnotes
            )
        return manifest
