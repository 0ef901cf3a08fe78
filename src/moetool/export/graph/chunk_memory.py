"""The memory a chunked graph export (Core ML, ExecuTorch, TFLite) needs, estimated before anything is written.

A chunk's conversion runs in a process of its own and holds each tensor it converts some number of times over its
float32 bytes: traced constants, the converter's copies, the serialised artifact. The number depends on the target
and on whether the tensor is rounded before the converter sees it (ExecuTorch's torchao replaces a Linear's float
weight by its 4- or 8-bit one before export; Core ML and TFLite round after converting). :class:`Multiples` holds
each target's figures, measured per chunk; :func:`chunked_memory` adds the weights outside the layer stack that each
process's reader keeps and the runtime, for ``jobs`` processes at once, and the check's reference beside one chunk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from moetool.export.graph.chunk import chunk_layers, planned_chunks
from moetool.io.budget import Need

if TYPE_CHECKING:
    from pathlib import Path

    from moetool.export.base import ExportRequest
    from moetool.export.graph.common import GraphPlan

__all__ = [
    "CHUNKED_WAY_OUT",
    "ChunkPlan",
    "ChunkedMemory",
    "Multiples",
    "check_chunk_options",
    "chunk_bytes",
    "chunked_memory",
    "chunked_need",
    "plan_chunks",
]

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class Multiples:
    """How many times a chunk's conversion holds a tensor, over its float32 bytes: ``unrounded`` for one the plan
    keeps in float, ``rounded`` for one it rounds to int8 or int4 (None: the same as ``unrounded``); ``named``:
    (export name, multiple) for tensors a target handles its own way whatever the plan (ExecuTorch's embedding, a
    lookup torchao does not round; Core ML's embedding and head, single tensors copied whole at each step)."""

    unrounded: float
    rounded: float | None = None
    named: tuple[tuple[str, float], ...] = ()

    def of(self, name: str, precision: str) -> float:
        """The multiple of tensor ``name`` planned at ``precision`` (fp32, int8, int4)."""
        own = dict(self.named).get(name)
        if own is not None:
            return own
        if precision != "fp32" and self.rounded is not None:
            return self.rounded
        return self.unrounded


def chunk_bytes(plan: GraphPlan, ranges: list[tuple[int, int]], multiples: Multiples) -> list[int]:
    """What each chunk of ``ranges`` holds while it is converted: each tensor it converts, its float32 bytes times
    its multiple. A chunk converts its layers' tensors; the first the embedding, the last the final norm and the head
    (an ExportLM's head is a tensor of its own, tied or not)."""
    precisions = plan.precisions()
    chunk_of = {i: c for c, (a, b) in enumerate(ranges) for i in range(a, b)}
    held = [0.0] * len(ranges)
    for a in plan.quant.assignments:
        name = str(a.entry.out_name)
        m = _LAYER.match(name)
        c = chunk_of[int(m.group(1))] if m else 0 if name == "embed.weight" else len(ranges) - 1
        held[c] += a.params * 4 * multiples.of(name, precisions[name])
    return [int(h) for h in held]


@dataclass(frozen=True)
class ChunkedMemory:
    """The memory of a graph export converted chunk by chunk (:func:`chunked_memory`): ``converting`` (``jobs`` of
    the largest chunk's conversion at once), ``verifying`` (the reference beside one chunk), whether the reference is
    ``held`` in float32, and ``chunks``, how the model is cut, in words."""

    converting: int
    verifying: int
    held: bool
    chunks: str
    jobs: int = 1

    def peak(self, verify: bool) -> int:
        return max(self.converting, self.verifying) if verify else self.converting

    def at_once(self, jobs: int) -> ChunkedMemory:
        """This memory, of one conversion at a time, with ``jobs`` conversions at once, each holding its chunk."""
        if jobs <= 1:
            return self
        return replace(self, converting=jobs * self.converting, chunks=f"{self.chunks}, {jobs} at once", jobs=jobs)


# how a chunked export that does not fit gets out
CHUNKED_WAY_OUT = (
    "Export in smaller chunks (--chunk-layers), fewer at once (--jobs), with --no-verify, or on a machine with more "
    "memory"
)


def chunked_memory(
    plan: GraphPlan,
    ranges: list[tuple[int, int]],
    *,
    multiples: Multiples,
    runtime: int,
    piece: str,
    jobs: int = 1,
) -> ChunkedMemory:
    """Memory of exporting ``plan`` in ``ranges``' chunks, ``jobs`` at once: each conversion holds the largest
    chunk's tensors ``multiples`` times (:func:`chunk_bytes`), beside the weights outside the layer stack its reader
    keeps and ``runtime``; verifying holds the transformers reference (in float32 or streamed,
    :func:`moetool.export.reference.graph_reference_need`, whose allowance covers the runtime) beside one chunk.
    ``piece`` names a chunk's artifact (package, program, model)."""
    from moetool.compute.upcast import layer_bytes
    from moetool.export.reference import graph_reference_need

    params = plan.quant.total_params
    outside, layer = layer_bytes(plan.config, params)
    most = max(b - a for a, b in ranges)
    one = max(chunk_bytes(plan, ranges, multiples)) + outside + runtime
    reference, held = graph_reference_need(params, plan.config)
    chunks = f"{len(ranges)} {piece}{'s' * (len(ranges) > 1)} of up to {most} layer{'s' * (most > 1)}"
    return ChunkedMemory(one, reference + outside + most * layer, held, chunks).at_once(jobs)


@dataclass(frozen=True)
class ChunkPlan:
    """How a chunked export runs: the chunks' layer ``ranges``, and its ``memory`` (whose ``jobs`` chunks are
    converted at once)."""

    ranges: list[tuple[int, int]]
    memory: ChunkedMemory

    @property
    def jobs(self) -> int:
        return self.memory.jobs


def plan_chunks(
    req: ExportRequest,
    plan: GraphPlan,
    chunk_bytes_: int,
    *,
    multiples: Multiples,
    runtime: int,
    piece: str,
    in_child: bool = True,
) -> ChunkPlan:
    """The chunks of ``plan``'s model (:func:`moetool.export.graph.chunk.planned_chunks`, ``chunk_bytes_`` of float32
    layers each by default) and how many are converted at once: ``--jobs``, else as many as the cores and the
    available memory allow (:func:`moetool.export.graph.jobs.planned_jobs`); one when the chunks are not converted
    ``in_child`` processes.

    Raises:
        ExportError: ``--chunk-layers`` or ``--jobs`` below 1.
    """
    from moetool.export.graph.jobs import planned_jobs
    from moetool.io.budget import available_memory

    ranges = planned_chunks(req, plan, chunk_bytes_)
    one = chunked_memory(plan, ranges, multiples=multiples, runtime=runtime, piece=piece)
    jobs = planned_jobs(req, len(ranges), one.converting, available_memory()) if in_child else 1
    return ChunkPlan(ranges, one.at_once(jobs))


def chunked_need(
    chunks: ChunkPlan, stage: str, detail: str, *, verify: bool, output: Path, disk: int, memory: int | None = None
) -> Need:
    """What a chunked export of ``stage`` needs: ``memory`` (by default its chunks' peak, ``verify``-ing or not),
    ``detail`` saying how it was estimated, ``disk`` bytes under ``output``, and :data:`CHUNKED_WAY_OUT`."""
    return Need(
        stage=stage,
        memory=chunks.memory.peak(verify) if memory is None else memory,
        memory_detail=detail,
        disk=disk,
        output=output,
        way_out=CHUNKED_WAY_OUT,
    )


def check_chunk_options(req: ExportRequest) -> None:
    """Refuse ``--chunk-layers`` or ``--jobs`` below 1 (a chunked exporter's ``check``, before anything is read).

    Raises:
        ExportError: naming the option.
    """
    from moetool.export.graph.jobs import given_jobs

    chunk_layers(req)
    given_jobs(req)
