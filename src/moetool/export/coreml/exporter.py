"""``moetool export --target coreml``: ONE stateful ML Program (iOS 18), ``model.mlpackage``, with the KV cache as
Core ML states and per-weight compression from the plan, converted from the checkpoint a chunk of decoder layers at a
time and joined.

The model is never held whole (:mod:`moetool.export.graph.stream`): each chunk's layers
(:mod:`moetool.export.coreml.chunks`) are read, traced, converted, compressed and saved as a package of its own in a
process of their own (:mod:`moetool.export.coreml.worker`), which exits before the next chunk is read. Every chunk
declares the model-wide states and the conventional names (Apple's stateful Llama, swift-transformers'
``LanguageModel``): ``inputIds`` and ``causalMask`` in, ``logits`` out, states ``keyCache``/``valueCache``; the
chunks are then joined at the protobuf level into one program (:mod:`moetool.export.coreml.join`: their weights
copied, never loaded) and removed. A model whose layers fit one chunk is converted straight to ``model.mlpackage``.

On Linux Core ML cannot run (``predict`` needs macOS), so the proof is split: the *exact torch wrappers that were
converted* (:class:`StatefulChunk`, run in sequence) are compared with transformers (prefill at two lengths, then
cached decode), and the package written is read back and checked structurally — spec version, states, inputs and
outputs, the program loaded into coremltools' MIL (which type-checks every op), its weight blobs against the chunks'
and which weights were compressed to what. ``scripts/coreml_parity_mac.py`` runs the numeric check on a Mac.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetool.export.base import NOT_VERIFIED, ExportError, ExportRequest
from moetool.export.coreml.chunks import CHUNK_BYTES, MODEL_FILE, cache_bytes, chunk_batch, chunk_file
from moetool.export.coreml.convert import compress, convert
from moetool.export.coreml.join import Joined
from moetool.export.coreml.package import check_package, description, hf_metadata, package_structure, structure
from moetool.export.coreml.stateful import STATES, StatefulChunk
from moetool.export.graph.chunk_memory import ChunkPlan, Multiples, check_chunk_options, chunked_need, plan_chunks
from moetool.export.graph.common import GraphPlan
from moetool.export.graph.jobs import run_chunks, worker_env
from moetool.export.graph.moe_kernel import dense_moe_kernel
from moetool.export.parity import ParityRecord
from moetool.export.pipeline_steps import GraphExporter, finish_graph_manifest, reference_parity
from moetool.io.atomic import atomic_dir
from moetool.io.budget import Need, human
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.progress import Step, step_printer

if TYPE_CHECKING:
    from rich.console import Console

    from moetool.export.graph.stream import StreamedExport

COMPUTE_UNITS = ("ALL", "CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE")


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


def capacity_of(plan: GraphPlan) -> int:
    """The cache's positions: the plan's context, at most the model's."""
    return min(int(plan.config.get("max_position_embeddings", 2048)), plan.context)


def coreml_chunks(req: ExportRequest, plan: GraphPlan) -> ChunkPlan:
    """The chunks of ``plan`` and how many are converted at once
    (:func:`moetool.export.graph.chunk_memory.plan_chunks`): a conversion (in a process of its own) holds each tensor
    it converts :data:`CONVERT_MULTIPLES` times, beside the weights outside the layer stack that the reader keeps and
    the model-wide cache buffers every chunk's wrapper declares (:func:`cache_bytes`)."""
    runtime = RUNTIME + cache_bytes(plan.config, capacity_of(plan))
    return plan_chunks(
        req, plan, CHUNK_BYTES, multiples=CONVERT_MULTIPLES, runtime=runtime, piece="chunk", in_child=IN_CHILD
    )


def coreml_need(chunks: ChunkPlan, *, verify: bool, output: Path, disk: int) -> Need:
    """Memory and disk of a Core ML export in ``chunks`` (:func:`coreml_chunks`): ``jobs`` conversions at once;
    verification holds the transformers reference (held in float32 or streamed,
    :func:`moetool.export.reference.graph_reference_need`) beside one chunk of the converted wrappers. The join holds
    no weight, but the structural check's MIL loader holds the package's (``disk``, the planned bytes), after the
    conversions: the larger of the two. Disk: the chunks and the joined package overlap by one chunk (the join removes
    each once copied)."""
    mem = chunks.memory
    how = "held in float32" if mem.held else "streamed from disk, one float32 layer at a time"
    detail = (
        f"converted in {mem.chunks} ({human(mem.converting)}); verified against the model {how}"
        if verify
        else f"converted in {mem.chunks}"
    )
    memory = max(mem.peak(verify), RUNTIME + disk)
    return chunked_need(chunks, "coreml export", detail, verify=verify, output=output, disk=disk, memory=memory)


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
    request |= {"metadata": job.metadata}
    result = run_worker("moetool.export.coreml.worker", request, what="Core ML conversion", env=env)
    return Converted(dict(result["compressed"]), result["structure"])


@dataclass(frozen=True)
class ChunkJob:
    """One package to convert: layers ``[start, stop)``, whether it is the first or last chunk, and how (the plan's
    precisions, the cache capacity, the compute units) into ``path``, with ``metadata`` (user-defined; the join
    keeps the first chunk's)."""

    layers: tuple[int, int]
    first: bool
    last: bool
    precisions: dict[str, str]
    capacity: int
    units: str
    path: Path
    metadata: dict[str, str]


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
    for k, v in job.metadata.items():
        ml.user_defined_metadata[k] = v
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
        metadata={str(k): str(v) for k, v in request.get("metadata", {}).items()},
    )
    done = convert_chunk(streamed_export_model(Path(request["model_dir"])), job)
    return {"compressed": {**done.compressed}, "structure": done.structure}


# each chunk is converted in a process of its own: coremltools and the trace leave about 0.5 GB allocated over a
# model's chunks (the 360M rung's last chunk peaked at 2.33 GB alone, 3.14 GB after 16 others in one process). False
# converts them all here, from one reader: what tests that watch the tensors alive at each conversion use
IN_CHILD = True


def _peak_rss() -> int | None:
    """This process's peak resident memory in bytes, when the chunks were converted in processes of their own (else
    the conversions' peak, not the join's: None)."""
    if not IN_CHILD:
        return None
    import resource
    import sys

    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kilobytes on Linux


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
        capacity = capacity_of(plan)
        fp16 = True  # Core ML states are fp16 only, so the program computes in fp16; fp32 means "no compression"
        chunks = coreml_chunks(req, plan)
        ranges = chunks.ranges
        src = None if IN_CHILD else streamed_export_model(req.model_dir)
        env = worker_env(chunks.jobs)
        metadata = hf_metadata(plan, "float16" if fp16 else "float32")
        applied: dict[str, str] = {}
        with atomic_dir(req.output, force=req.force) as tmp:
            # the chunks are converted beside the package they are joined into, then removed (one chunk: straight
            # to the package)
            where = tmp if len(ranges) == 1 else tmp / "chunks"
            where.mkdir(exist_ok=True)

            def convert_one(c: int, span: tuple[int, int]) -> Converted:
                how = " in a child process" if IN_CHILD else ""
                step(
                    f"converting layers {span[0]}–{span[1] - 1} (chunk {c + 1} of {len(ranges)}) with coremltools{how}"
                )
                path = where / chunk_file(c, len(ranges))
                last = c == len(ranges) - 1
                job = ChunkJob(span, c == 0, last, plan.precisions(), capacity, units, path, metadata)
                return _converted(req.model_dir, job, env) if src is None else convert_chunk(src, job, fp16)

            if chunks.jobs > 1:
                step(f"converting {len(ranges)} chunks, {chunks.jobs} at once")
            converted = run_chunks(ranges, convert_one, chunks.jobs)
            records: list[JsonValue] = []
            for span, done in zip(ranges, converted, strict=True):
                info = done.structure
                if info["states"] != list(STATES) or not info["ios18_or_later"]:
                    raise ExportError(f"Core ML program lacks the KV-cache states or iOS 18 spec: {info['states']}")
                applied |= done.compressed
                records.append({"layers": [span[0], span[1]], "structure": info})
            joined: Joined | None = None
            join_peak = None
            if len(ranges) > 1:
                from moetool.export.coreml.join import join_packages

                step(f"joining the {len(ranges)} chunks into one {MODEL_FILE} (weights copied, never loaded)")
                parts = [where / chunk_file(c, len(ranges)) for c in range(len(ranges))]
                joined = join_packages(parts, tmp / MODEL_FILE, description=description(plan), consume=True)
                where.rmdir()
                join_peak = _peak_rss()
            step(f"reading {MODEL_FILE} back: spec, states, names, its program in coremltools' MIL, its weight blobs")
            info = package_structure(tmp / MODEL_FILE, None if joined is None else joined.blobs)
            check_package(info, joined)
            parity: ParityRecord | str = NOT_VERIFIED
            if req.verify:
                reader = src if src is not None else streamed_export_model(req.model_dir)
                parity = self._verify(req, plan, reader, ranges, capacity, step)
            files = {p.relative_to(tmp).as_posix(): p for p in sorted(tmp.rglob("*")) if p.is_file()}
            fields: JsonObject = {
                "file": MODEL_FILE,  # a package is a folder: its Manifest.json stands for it
                "runtime": "Core ML (iOS 18 / macOS 15), stateful KV cache",
                "export": "streamed: each chunk of decoder layers read from the checkpoint and converted"
                + (" in a process of its own" if IN_CHILD else ", one at a time")
                + (f", the {len(ranges)} chunks joined into one program" if joined is not None else ""),
                "compute_units": units,
                "compute_precision": "float16" if fp16 else "float32",
                "capacity": capacity,
                "structure": info,
                "chunks": records,  # what the package was converted from: each chunk's layers and program
                # this process's peak so far: with the conversions in child processes, what the join (and the
                # planning before it) held; nothing here had read a weight yet
                "join": None if joined is None else {**joined.record(), "process_peak_bytes": join_peak},
                "jobs": chunks.jobs,
                "compressed_weights": {k: v for k, v in sorted(applied.items())},
                "moe_kernel": dense_moe_kernel("coreml", _moe_layers(plan)),
            }
            main = f"{MODEL_FILE}/Manifest.json"
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
        from moetool.export.reference import graph_reference

        ref = graph_reference(req.model_dir, plan.quant.total_params, plan.config)
        step(f"checking the converted wrappers against {ref.label} (Core ML predicts only on macOS)")
        parity = reference_parity(
            req,
            ref,
            chunk_batch(src, ranges, capacity),
            runtime="torch: the StatefulChunk wrappers that were converted, in sequence",
            gate_as="Core ML wrapper",
            seq_lens=(32, min(128, capacity)),
        )
        return replace(parity, runtime_not_run="not run: Core ML prediction needs macOS (scripts/coreml_parity_mac.py)")
