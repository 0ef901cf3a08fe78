"""``moetool export --target coreml``: a stateful ML Program (iOS 18) with the KV cache as Core ML states and
per-weight compression from the plan.

On Linux Core ML cannot run (``predict`` needs macOS), so the proof is split: the *exact torch wrapper that was
converted* (:class:`StatefulLM`) is compared with transformers (prefill at two lengths, then cached decode), and the
converted program is checked structurally — spec version, states, inputs and outputs, op histogram, and which
weights were compressed to what. ``scripts/coreml_parity_mac.py`` runs the numeric check on a Mac.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from moetool.export.base import NOT_VERIFIED, ExportError, ExportRequest
from moetool.export.coreml.stateful import StatefulLM
from moetool.export.graph.common import GraphPlan
from moetool.export.graph.model import causal_mask
from moetool.export.graph.parity import Decode, Prefill
from moetool.export.parity import ParityRecord
from moetool.export.pipeline_steps import GraphExporter, finish_graph_manifest, runtime_parity
from moetool.io.atomic import atomic_dir
from moetool.io.jsontypes import JsonObject
from moetool.progress import Step

if TYPE_CHECKING:
    from coremltools.models import MLModel
    from coremltools.optimize.coreml import OpLinearQuantizerConfig

    from moetool.export.graph.model import ExportLM

BLOCK = 32
COMPUTE_UNITS = ("ALL", "CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE")


def convert(model: ExportLM, capacity: int, fp16: bool, compute_units: str) -> MLModel:
    import coremltools as ct

    wrapper = StatefulLM(model, capacity).eval()
    example = (torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], causal_mask(8, 0))
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, example)
    dt = np.float16 if fp16 else np.float32
    seq = ct.RangeDim(1, capacity)
    return ct.convert(
        traced,
        inputs=[
            ct.TensorType(name="input_ids", shape=(1, seq), dtype=np.int32),
            ct.TensorType(name="position_ids", shape=(1, seq), dtype=np.int32),
            ct.TensorType(name="mask", shape=(1, 1, seq, ct.RangeDim(1, capacity)), dtype=dt),
        ],
        outputs=[ct.TensorType(name="logits", dtype=dt)],
        states=[
            ct.StateType(wrapped_type=ct.TensorType(shape=tuple(wrapper.k_cache.shape), dtype=dt), name=n)
            for n in ("k_cache", "v_cache")
        ],
        minimum_deployment_target=ct.target.iOS18,
        convert_to="mlprogram",
        compute_precision=ct.precision.FLOAT16 if fp16 else ct.precision.FLOAT32,
        compute_units=getattr(ct.ComputeUnit, compute_units),
        skip_model_load=True,
    )


def weight_op_name(export_name: str, fp16: bool) -> str:
    """The const op Core ML names after a wrapper parameter (``model.`` prefix, dots → underscores)."""
    base = "model_" + export_name.replace(".", "_")
    return base + ("_to_fp16" if fp16 else "")


def compress(ml: MLModel, precisions: dict[str, str], fp16: bool) -> tuple[MLModel, dict[str, str]]:
    """int4 per-block (32) or int8 per-channel linear quantization by weight name; others untouched."""
    import coremltools.optimize.coreml as cto

    meta = cto.get_weights_metadata(ml, weight_threshold=64)  # lower thresholds trip on list consts
    configs: dict[str, OpLinearQuantizerConfig] = {}
    applied: dict[str, str] = {}
    for name, p in precisions.items():
        op = weight_op_name(name, fp16)
        if op not in meta or p == "fp32":
            continue
        if p == "int4":
            # blocks run along the input axis; an input width 32 does not divide takes the largest block that does
            k = int(meta[op].val.shape[-1])
            block = next((b for b in (BLOCK, 16, 8, 4) if k % b == 0), None)
            if block is None:
                configs[op] = cto.OpLinearQuantizerConfig(
                    mode="linear_symmetric", dtype="int4", granularity="per_channel", weight_threshold=1
                )
                applied[name] = "int4 per channel"
                continue
            configs[op] = cto.OpLinearQuantizerConfig(
                mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=block, weight_threshold=1
            )
            applied[name] = f"int4 block {block}"
            continue
        configs[op] = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=1
        )
        applied[name] = "int8 per channel"
    if not configs:
        return ml, applied
    return cto.linear_quantize_weights(ml, cto.OptimizationConfig(op_name_configs=configs)), applied


def structure(ml: MLModel, path: Path) -> JsonObject:
    import coremltools as ct

    spec = ml.get_spec()
    ops = Counter(op.op_type for op in ml._mil_program.functions["main"].operations)
    reloaded = ct.models.MLModel(str(path), skip_model_load=True)
    return {
        "spec_version": spec.specificationVersion,
        "ios18_or_later": spec.specificationVersion >= 9,
        "states": [s.name for s in spec.description.state],
        "inputs": [i.name for i in spec.description.input],
        "outputs": [o.name for o in spec.description.output],
        "reloads": reloaded.get_spec().specificationVersion == spec.specificationVersion,
        "ops": {**dict(ops.most_common())},
        "compressed_weight_ops": {k: v for k, v in ops.items() if k.startswith("constexpr_")},
    }


def _wrapper_runners(wrapper: StatefulLM) -> tuple[Prefill, Decode]:
    """Prefill and decode through the converted torch wrapper itself: its KV cache lives in its own buffers (the
    Core ML states), so no past is passed around and prefill starts from an empty cache."""

    def prefill(ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        wrapper.k_cache.zero_()
        wrapper.v_cache.zero_()
        t = ids.shape[1]
        with torch.no_grad():
            out = wrapper(torch.from_numpy(ids), torch.arange(t)[None], causal_mask(t, 0))
        return out.numpy(), []

    def decode(ids: np.ndarray, pos: int, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        with torch.no_grad():
            out = wrapper(torch.from_numpy(ids), torch.tensor([[pos]]), causal_mask(1, pos))
        return out.numpy(), []

    return prefill, decode


def _wrapper_parity(req: ExportRequest, hf: nn.Module, em: ExportLM, capacity: int) -> ParityRecord:
    """Parity of the torch wrapper that was converted (Core ML itself runs on macOS only), held to the fp32 gate."""

    prefill, decode = _wrapper_runners(StatefulLM(em, capacity).eval())
    parity = runtime_parity(
        req,
        hf,
        em,
        prefill,
        decode,
        runtime="torch: the StatefulLM wrapper that was converted",
        gate_as="Core ML wrapper",
        seq_lens=(32, min(128, capacity)),
    )
    return replace(parity, runtime_not_run="not run: Core ML prediction needs macOS (scripts/coreml_parity_mac.py)")


def _compute_units(req: ExportRequest) -> str:
    units = str(req.options.get("compute_units", "CPU_AND_NE"))
    if units not in COMPUTE_UNITS:
        raise ExportError(f"compute units {units!r}; choose one of {', '.join(COMPUTE_UNITS)}")
    return units


class CoreMLExporter(GraphExporter):
    peak_multiple, peak_measured = 5.0, True  # 6.5 GB for the 1.29 GB (float32) real MoE
    name = "coreml"
    requires = "coreml"
    runtime_modules = ("coremltools",)

    def check(self, req: ExportRequest) -> None:
        _compute_units(req)

    def write(
        self, req: ExportRequest, plan: GraphPlan, hf: nn.Module, em: ExportLM, *, started: float, step: Step
    ) -> JsonObject:
        units = _compute_units(req)
        max_pos = int(plan.config.get("max_position_embeddings", 2048))
        capacity = min(max_pos, plan.context)
        # Core ML states are fp16 only, so the program computes in fp16; an f32 plan means "no weight compression"
        fp16 = True
        step("converting to a Core ML program with coremltools")
        ml = convert(em, capacity, fp16, units)
        ml, applied = compress(ml, plan.precisions(), fp16)
        with atomic_dir(req.output, force=req.force) as tmp:
            path = tmp / "model.mlpackage"
            ml.save(str(path))
            info = structure(ml, path)
            if info["states"] != ["k_cache", "v_cache"] or not info["ios18_or_later"]:
                raise ExportError(f"Core ML program lacks the KV-cache states or iOS 18 spec: {info['states']}")
            if req.verify:
                step("checking the traced wrapper against transformers (Core ML predicts only on macOS)")
            parity: ParityRecord | str = _wrapper_parity(req, hf, em, capacity) if req.verify else NOT_VERIFIED
            files = {p.relative_to(tmp).as_posix(): p for p in path.rglob("*") if p.is_file()}
            fields: JsonObject = {
                "file": "model.mlpackage",  # a package is a folder: its Manifest.json stands for it in the hashes
                "runtime": "Core ML (iOS 18 / macOS 15), stateful KV cache",
                "compute_units": units,
                "compute_precision": "float16" if fp16 else "float32",
                "capacity": capacity,
                "structure": info,
                "compressed_weights": {k: v for k, v in sorted(applied.items())},
            }
            main = "model.mlpackage/Manifest.json"
            manifest = finish_graph_manifest(tmp, "coreml", plan, files, main, fields, parity=parity, started=started)
        return manifest
