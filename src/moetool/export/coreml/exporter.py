"""``moetool export --target coreml``: stateful ML Programs (iOS 18) with the KV cache as Core ML states and
per-weight compression from the plan, converted from the checkpoint a chunk of decoder layers at a time.

The model is never held whole (:mod:`moetool.export.graph.stream`): each chunk's layers
(:mod:`moetool.export.coreml.chunks`) are read, traced, converted, compressed and saved as one ``.mlpackage`` in a
process of their own (:mod:`moetool.export.coreml.worker`), which exits before the next chunk is read. A model whose layers fit one chunk is one
``model.mlpackage`` (``input_ids`` in, ``logits`` out); a larger one is ``model_chunk00.mlpackage`` … run in
sequence, hidden states passed from one to the next, each with its own cache.

On Linux Core ML cannot run (``predict`` needs macOS), so the proof is split: the *exact torch wrappers that were
converted* (:class:`StatefulChunk`, run in sequence) are compared with transformers (prefill at two lengths, then
cached decode), and each converted program is checked structurally — spec version, states, inputs and outputs, op
histogram, and which weights were compressed to what. ``scripts/coreml_parity_mac.py`` runs the numeric check on a
Mac.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moetool.export.base import NOT_VERIFIED, ExportError, ExportRequest
from moetool.export.coreml.chunks import CHUNK_BYTES, chunk_batch, chunk_file
from moetool.export.coreml.stateful import StatefulChunk
from moetool.export.graph.chunk_memory import ChunkPlan, Multiples, check_chunk_options, plan_chunks
from moetool.export.graph.common import GraphPlan
from moetool.export.graph.jobs import run_chunks, worker_env
from moetool.export.graph.model import causal_mask
from moetool.export.graph.moe_kernel import dense_moe_kernel
from moetool.export.parity import ParityRecord
from moetool.export.pipeline_steps import GraphExporter, finish_graph_manifest, runtime_parity
from moetool.io.atomic import atomic_dir
from moetool.io.budget import Need, human
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.progress import Step, step_printer

if TYPE_CHECKING:
    from coremltools.models import MLModel
    from coremltools.optimize.coreml import OpLinearQuantizerConfig
    from rich.console import Console

    from moetool.export.graph.stream import StreamedExport

BLOCK = 32
COMPUTE_UNITS = ("ALL", "CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE")


def convert(chunk: StatefulChunk, fp16: bool, compute_units: str) -> MLModel:
    """``chunk`` traced and converted: ``input_ids`` (the first chunk) or ``hidden_states`` [1, T, D] in,
    ``logits`` (the last) or ``next_hidden_states`` out, ``position_ids`` and ``mask`` beside; T up to its capacity."""
    import coremltools as ct

    capacity = chunk.capacity
    dt = np.float16 if fp16 else np.float32
    seq = ct.RangeDim(1, capacity)
    if chunk.first:
        x = torch.zeros(1, 8, dtype=torch.long)
        first = ct.TensorType(name="input_ids", shape=(1, seq), dtype=np.int32)
    else:
        hidden = chunk.hidden_size
        x = torch.zeros(1, 8, hidden)
        first = ct.TensorType(name="hidden_states", shape=(1, seq, hidden), dtype=dt)
    example = (x, torch.arange(8)[None], causal_mask(8, 0))
    with torch.no_grad():
        traced = torch.jit.trace(chunk, example)
    return ct.convert(
        traced,
        inputs=[
            first,
            ct.TensorType(name="position_ids", shape=(1, seq), dtype=np.int32),
            ct.TensorType(name="mask", shape=(1, 1, seq, ct.RangeDim(1, capacity)), dtype=dt),
        ],
        outputs=[ct.TensorType(name="logits" if chunk.last else "next_hidden_states", dtype=dt)],
        states=[
            ct.StateType(wrapped_type=ct.TensorType(shape=tuple(chunk.k_cache.shape), dtype=dt), name=n)
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


def _compute_units(req: ExportRequest) -> str:
    units = str(req.options.get("compute_units", "CPU_AND_NE"))
    if units not in COMPUTE_UNITS:
        raise ExportError(f"compute units {units!r}; choose one of {', '.join(COMPUTE_UNITS)}")
    return units


# peak RSS of one chunk's conversion (its own process) over the float32 bytes of each tensor it converts, above the
# runtime and the weights outside the layers (traced constants, MIL's float32 and float16 copies, the compressed ones,
# the serialised blob). Float: about five times, 6.5 GB for the 1.29 GB real MoE converted whole. Compressed, from the
# 1.7B rung's one-layer packages at moe-q4 (2026-11-29): a middle one 2.90 GB (its layer 1.94x); the first 5.18 GB
# and the last 5.62 GB, the embedding and the head (one 0.40 GB tensor each, compressed to int8 per channel) 5.7x and
# 6.8x: a large tensor is copied whole at each step, where a layer's many small ones pass one at a time
CONVERT_MULTIPLES = Multiples(5.0, 2.2, (("embed.weight", 6.5), ("lm_head.weight", 7.5)))
RUNTIME = 768 << 20  # torch, coremltools and the traced graph


def coreml_chunks(req: ExportRequest, plan: GraphPlan) -> ChunkPlan:
    """The packages of ``plan`` and how many are converted at once
    (:func:`moetool.export.graph.chunk_memory.plan_chunks`): a conversion (in a process of its own) holds each tensor
    it converts :data:`CONVERT_MULTIPLES` times, beside the weights outside the layer stack that the reader keeps."""
    return plan_chunks(
        req, plan, CHUNK_BYTES, multiples=CONVERT_MULTIPLES, runtime=RUNTIME, piece="chunk", in_child=IN_CHILD
    )


def coreml_need(chunks: ChunkPlan, *, verify: bool, output: Path, disk: int) -> Need:
    """Memory and disk of a Core ML export in ``chunks`` (:func:`coreml_chunks`): ``jobs`` conversions at once;
    verification holds the transformers reference (held in float32 or streamed,
    :func:`moetool.export.reference.graph_reference_need`) beside one chunk of the converted wrappers."""
    from moetool.export.graph.chunk_memory import CHUNKED_WAY_OUT

    mem = chunks.memory
    how = "held in float32" if mem.held else "streamed from disk, one float32 layer at a time"
    return Need(
        stage="coreml export",
        memory=mem.peak(verify),
        memory_detail=f"converted in {mem.chunks} ({human(mem.converting)}); verified against the model {how}"
        if verify
        else f"converted in {mem.chunks}",
        disk=disk,
        output=output,
        way_out=CHUNKED_WAY_OUT,
    )


def _package(src: StreamedExport, span: tuple[int, int], capacity: int, ends: tuple[bool, bool]) -> StatefulChunk:
    """The wrapper of layers ``span`` read from the checkpoint; ``ends``: (first chunk, last chunk)."""
    blocks = {i: src.block(i) for i in range(*span)}
    return StatefulChunk(src.em, blocks, capacity, first=ends[0], last=ends[1]).eval()


def _converted(model_dir: Path, job: ChunkJob, env: dict[str, str] | None = None) -> Converted:
    """``job`` converted by ``python -m moetool.export.coreml.worker`` (:data:`IN_CHILD`), with ``env`` added to its
    environment."""
    from moetool.export.worker import run_worker

    request = {"model_dir": str(model_dir), "layers": list(job.layers), "first": job.first, "last": job.last}
    request |= {"precisions": job.precisions, "capacity": job.capacity, "units": job.units, "path": str(job.path)}
    result = run_worker("moetool.export.coreml.worker", request, what="Core ML conversion", env=env)
    return Converted(dict(result["compressed"]), result["structure"])


@dataclass(frozen=True)
class ChunkJob:
    """One package to convert: layers ``[start, stop)``, whether it is the first or last chunk, and how (the plan's
    precisions, the cache capacity, the compute units) into ``path``."""

    layers: tuple[int, int]
    first: bool
    last: bool
    precisions: dict[str, str]
    capacity: int
    units: str
    path: Path


@dataclass(frozen=True)
class Converted:
    """What converting a chunk gave: each compressed weight's form, and the saved program's structure."""

    compressed: dict[str, str]
    structure: JsonObject


def convert_chunk(src: StreamedExport, job: ChunkJob, fp16: bool = True) -> Converted:
    """``job``'s layers read from ``src``, traced, converted (the torch weights dropped before compression),
    compressed per the plan and saved."""
    wrapper = _package(src, job.layers, job.capacity, (job.first, job.last))
    ml = convert(wrapper, fp16, job.units)
    del wrapper  # the program holds its own copy: the torch weights go before it is compressed
    for i in range(*job.layers):
        src.drop(i)
    ml, done = compress(ml, job.precisions, fp16)
    ml.save(str(job.path))
    return Converted(done, structure(ml, job.path))


def converted_in_child(request: dict[str, Any]) -> JsonObject:
    """The worker of :mod:`moetool.export.coreml.worker`: the request's chunk read from its checkpoint alone."""
    from moetool.export.graph.stream import streamed_export_model

    start, stop = request["layers"]
    job = ChunkJob(
        layers=(int(start), int(stop)),
        first=bool(request["first"]),
        last=bool(request["last"]),
        precisions=dict(request["precisions"]),
        capacity=int(request["capacity"]),
        units=str(request["units"]),
        path=Path(request["path"]),
    )
    done = convert_chunk(streamed_export_model(Path(request["model_dir"])), job)
    return {"compressed": {**done.compressed}, "structure": done.structure}


# each chunk is converted in a process of its own: coremltools and the trace leave about 0.5 GB allocated over a
# model's chunks (the 360M rung's last chunk peaked at 2.33 GB alone, 3.14 GB after 16 others in one process). False
# converts them all here, from one reader: what tests that watch the tensors alive at each conversion use
IN_CHILD = True


def _moe_layers(plan: GraphPlan) -> int:
    """The MoE blocks of the planned model (each written dense-masked)."""
    from moetool.export.graph.common import meta_export_model

    return meta_export_model(plan.config).moe_layers()


class CoreMLExporter(GraphExporter):
    """Streamed: converted a chunk of decoder layers at a time from the checkpoint (:mod:`moetool.export.coreml.
    chunks`); the model is never held whole."""

    name = "coreml"
    requires = "coreml"
    runtime_modules = ("coremltools",)

    def check(self, req: ExportRequest) -> None:
        _compute_units(req)
        check_chunk_options(req)

    def need(self, req: ExportRequest, plan: GraphPlan) -> Need:
        chunks = coreml_chunks(req, plan)
        return coreml_need(chunks, verify=req.verify, output=req.output, disk=plan.quant.total_bytes)

    def export(self, req: ExportRequest, plan: GraphPlan, console: Console | None = None) -> JsonObject:
        from moetool.export.graph.stream import streamed_export_model

        self.ready(req, plan)
        started = time.perf_counter()
        step = step_printer(console, started)
        units = _compute_units(req)
        capacity = min(int(plan.config.get("max_position_embeddings", 2048)), plan.context)
        fp16 = True  # Core ML states are fp16 only, so the program computes in fp16; fp32 means "no compression"
        chunks = coreml_chunks(req, plan)
        ranges = chunks.ranges
        src = None if IN_CHILD else streamed_export_model(req.model_dir)
        env = worker_env(chunks.jobs)
        applied: dict[str, str] = {}
        with atomic_dir(req.output, force=req.force) as tmp:

            def convert_one(c: int, span: tuple[int, int]) -> Converted:
                how = " in a child process" if IN_CHILD else ""
                step(
                    f"converting layers {span[0]}–{span[1] - 1} (chunk {c + 1} of {len(ranges)}) with coremltools{how}"
                )
                path = tmp / chunk_file(c, len(ranges))
                job = ChunkJob(span, c == 0, c == len(ranges) - 1, plan.precisions(), capacity, units, path)
                return _converted(req.model_dir, job, env) if src is None else convert_chunk(src, job, fp16)

            if chunks.jobs > 1:
                step(f"converting {len(ranges)} chunks, {chunks.jobs} at once")
            converted = run_chunks(ranges, convert_one, chunks.jobs)
            packages: list[JsonValue] = []
            for c, (span, done) in enumerate(zip(ranges, converted, strict=True)):
                info = done.structure
                if info["states"] != ["k_cache", "v_cache"] or not info["ios18_or_later"]:
                    raise ExportError(f"Core ML program lacks the KV-cache states or iOS 18 spec: {info['states']}")
                applied |= done.compressed
                packages.append({"file": chunk_file(c, len(ranges)), "layers": [span[0], span[1]], "structure": info})
            parity: ParityRecord | str = NOT_VERIFIED
            if req.verify:
                reader = src if src is not None else streamed_export_model(req.model_dir)
                parity = self._verify(req, plan, reader, ranges, capacity, step)
            files = {p.relative_to(tmp).as_posix(): p for p in sorted(tmp.rglob("*")) if p.is_file()}
            fields: JsonObject = {
                "file": chunk_file(0, len(ranges)),  # a package is a folder: its Manifest.json stands for it
                "runtime": "Core ML (iOS 18 / macOS 15), stateful KV cache",
                "export": "streamed: each chunk of decoder layers read from the checkpoint and converted"
                + (" in a process of its own" if IN_CHILD else ", one at a time"),
                "compute_units": units,
                "compute_precision": "float16" if fp16 else "float32",
                "capacity": capacity,
                "chunks": packages,
                "jobs": chunks.jobs,
                "structure": converted[0].structure if len(converted) == 1 else None,  # else each chunk's, in "chunks"
                "compressed_weights": {k: v for k, v in sorted(applied.items())},
                "moe_kernel": dense_moe_kernel("coreml", _moe_layers(plan)),
            }
            main = f"{chunk_file(0, len(ranges))}/Manifest.json"
            manifest = finish_graph_manifest(tmp, "coreml", plan, files, main, fields, parity=parity, started=started)
        return manifest

    def _verify(
        self,
        req: ExportRequest,
        plan: GraphPlan,
        src: StreamedExport,
        ranges: list[tuple[int, int]],
        capacity: int,
        step: Step,
    ) -> ParityRecord:
        """The converted wrappers, run chunk by chunk (:func:`chunk_batch`), against transformers (held in float32
        for a small model, with the whole ExportLM over its weights as the conversion's own figure; else streamed)."""
        from moetool.export.graph.model import ExportLM
        from moetool.export.reference import graph_reference

        ref = graph_reference(req.model_dir, plan.quant.total_params, plan.config)
        step(f"checking the converted wrappers against {ref.label} (Core ML predicts only on macOS)")
        parity = runtime_parity(
            req,
            ref.model,
            ExportLM(ref.model).eval() if ref.held else None,
            None,
            None,
            runtime="torch: the StatefulChunk wrappers that were converted, in sequence",
            gate_as="Core ML wrapper",
            seq_lens=(32, min(128, capacity)),
            reference=ref.label,
            batch=chunk_batch(src, ranges, capacity),
        )
        return replace(parity, runtime_not_run="not run: Core ML prediction needs macOS (scripts/coreml_parity_mac.py)")
