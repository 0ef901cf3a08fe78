"""``moetool export --target executorch``: programs with two methods each, ``forward`` (prefill, dynamic length)
and ``decode`` (one token against a KV cache of dynamic length), lowered to XNNPACK; parity through
``executorch.runtime``. Weights are quantized per the plan with torchao before export (int8 or int4 groupwise,
dynamic int8 activations: the forms XNNPACK runs), by module name, so the router and norms stay fp32.

Streamed, in chunks: the model is never held whole (:mod:`moetool.export.graph.stream`). Each chunk of consecutive
decoder layers (:class:`~moetool.export.graph.chunk.ExportChunk`) is read from the checkpoint, quantized, exported,
lowered and written as its own program, then dropped; a model whose layers fit one chunk is one ``model.pte``
(``input_ids`` in, ``logits`` out), a larger one ``model_chunk00.pte`` … run in sequence, hidden states passed on,
each chunk's KV cache its own inputs and outputs. The check runs the programs chunk by chunk over the parity calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from moetool.export.graph.parity import Batch, Call

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetool.export.base import NOT_VERIFIED, ExportError, ExportRequest
from moetool.export.executorch.lowering import Bounds, bounds_for
from moetool.export.graph.chunk import ChunkRunner, chain_calls, chunk_layers
from moetool.export.graph.chunk_memory import ChunkPlan, Multiples, check_chunk_options, chunked_memory, plan_chunks
from moetool.export.graph.common import GraphPlan
from moetool.export.graph.jobs import run_chunks
from moetool.export.graph.moe_kernel import dense_moe_kernel
from moetool.export.parity import ParityRecord
from moetool.export.pipeline_steps import GraphExporter, finish_graph_manifest, is_float_plan, reference_parity
from moetool.io.atomic import atomic_dir
from moetool.io.budget import Need, human
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.progress import Step, step_printer


def program_runner(path: Path) -> ChunkRunner:
    """One program's two methods through ``executorch.runtime``, as a chunk of the chain
    (:func:`moetool.export.graph.chunk.chain_calls`): no past is a prefill (``forward``), else ``decode``."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(path))
    fwd, step = program.load_method("forward"), program.load_method("decode")

    def run(
        x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, past: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = fwd.execute([x, pos, mask]) if past is None else step.execute([x, pos, mask, *past])
        return out[0], list(out[1:])

    return run


def program_batch(paths: list[Path]) -> Batch:
    """Every parity call through the programs at ``paths`` in sequence, one program loaded at a time."""

    def opener(path: Path) -> Callable[[], ChunkRunner]:
        return lambda: program_runner(path)

    def run_all(calls: list[Call]) -> list[np.ndarray]:
        return chain_calls(calls, (opener(p) for p in paths))

    return run_all


def _prefixed(step: Step, where: str) -> Step:
    """``step`` announcing each stage after ``where`` (which program of several)."""

    def announce(what: str) -> None:
        step(where + what)

    return announce


# each chunk is lowered in a process of its own (moetool.export.executorch.lowering says why); False lowers them all
# in this process, from one streamed reader: what tests that watch the tensors alive at each lowering use
IN_CHILD = True

# (layers [start, stop), first, last, program path, progress prefix) → the chunk's result (lowering.lower_chunk)
ChunkLowerer = Callable[[tuple[int, int], bool, bool, Path, str], dict[str, Any]]


def _chunk_lowerer(model_dir: Path, precisions: dict[str, str], bounds: Bounds, step: Step, jobs: int) -> ChunkLowerer:
    """How each chunk of the model in ``model_dir`` is lowered: in a child process (:data:`IN_CHILD`), which reads
    its layers itself (``jobs`` such processes at once share the cores), or here, from one reader of the checkpoint
    that each chunk's layers are dropped from."""
    from moetool.export.executorch import lowering
    from moetool.export.graph.jobs import worker_env
    from moetool.export.graph.stream import streamed_export_model
    from moetool.export.worker import run_worker

    if IN_CHILD:
        env = worker_env(jobs)

        def in_child(span: tuple[int, int], first: bool, last: bool, path: Path, where: str) -> dict[str, Any]:
            step(f"{where}torch.export and XNNPACK lowering, in a child process")
            request = {"model_dir": str(model_dir), "layers": list(span), "first": first, "last": last}
            request |= {"precisions": precisions, "path": str(path)}
            request |= {"prefill": bounds.prefill, "context": bounds.context}
            return run_worker("moetool.export.executorch.lowering", request, what="ExecuTorch lowering", env=env)

        return in_child
    step(f"reading {model_dir} outside its decoder layers")
    src = streamed_export_model(model_dir)

    def here(span: tuple[int, int], first: bool, last: bool, path: Path, where: str) -> dict[str, Any]:
        return lowering.lower_chunk(
            src,
            span,
            (first, last),
            precisions=precisions,
            path=path,
            bounds=bounds,
            step=_prefixed(step, where),
        )

    return here


def program_file(index: int, count: int) -> str:
    """The program name of chunk ``index`` of ``count``: ``model.pte`` when the model is one chunk."""
    return "model.pte" if count == 1 else f"model_chunk{index:02d}.pte"


# decoder layers' float32 weights per program, by default: torchao's quantization, torch.export and XNNPACK's
# lowering hold a chunk (and the embedding or head of the first and last) several times over
CHUNK_BYTES = 256 << 20
# peak RSS of one chunk's lowering (its own process) over the float32 bytes of each tensor it converts, above the
# runtime and the weights outside the layers. Float weights: two middle layers of the size ladder's 360M rung (256 MB
# of float32) peaked at 2.23 GB (6.6x). Weights torchao rounds (it replaces the float ones before export), from the
# 1.7B rung's one-layer programs at moe-q4 (2026-11-29): a middle one 2.12 GB, the last (+ the int8 head, 0.40 GB of
# float32) 2.74 GB: 1.53x; the first (+ the embedding, a float lookup) 3.19 GB: 2.67x for the embedding
LOWER_MULTIPLES = Multiples(7.0, 1.6, (("embed.weight", 2.8),))
RUNTIME = 768 << 20  # torch, torchao and executorch in the lowering process, torch in this one


def executorch_chunks(req: ExportRequest, plan: GraphPlan) -> ChunkPlan:
    """The programs of ``plan`` and how many are lowered at once
    (:func:`moetool.export.graph.chunk_memory.plan_chunks`): a chunk's lowering (in a process of its own) holds each
    tensor it converts :data:`LOWER_MULTIPLES` times, beside the weights outside the layer stack that its reader
    keeps."""
    return plan_chunks(
        req, plan, CHUNK_BYTES, multiples=LOWER_MULTIPLES, runtime=RUNTIME, piece="program", in_child=IN_CHILD
    )


# peak RSS of the runner program's lowering (one process, every layer) over the float32 bytes of each tensor: the
# layers are read and rounded one at a time, but XNNPACK's lowering of the whole graph then holds about 0.8x the
# rounded layers' float32 bytes more (four layers of the 360M rung at moe-q4: 0.93 → 1.36 GB across the lowering), so
# a rounded weight costs as in a chunk; and the graph itself costs memory by its size, not its weights' (the real
# SmolLM2 MoE's 30 narrow layers at moe-q4 peaked at 4.37 GB, the 360M rung's 32 wider ones at 6.94 GB,
# 2026-12-06), counted as RUNNER_LAYER per decoder layer: 4.9 and 10.3 GB estimated for those two
RUNNER_MULTIPLES = Multiples(7.0, 1.6, (("embed.weight", 2.8),))
RUNNER_LAYER = 60 << 20


def runner_chunks(plan: GraphPlan) -> ChunkPlan:
    """The runner program's plan: every layer in one lowering, in a process of its own, its memory estimated as a
    chunk's (:func:`moetool.export.graph.chunk_memory.chunked_memory`) at :data:`RUNNER_MULTIPLES`, plus
    :data:`RUNNER_LAYER` per decoder layer."""
    from dataclasses import replace

    n = int(plan.config["num_hidden_layers"])
    mem = chunked_memory(plan, [(0, n)], multiples=RUNNER_MULTIPLES, runtime=RUNTIME, piece="program")
    return ChunkPlan([(0, n)], replace(mem, converting=mem.converting + n * RUNNER_LAYER))


def executorch_need(chunks: ChunkPlan, *, verify: bool, output: Path, disk: int) -> Need:
    """Memory and disk of an ExecuTorch export in ``chunks`` (:func:`executorch_chunks`): ``jobs`` lowerings at
    once; verification holds the transformers reference (held in float32 or streamed) beside one chunk's program."""
    from moetool.export.graph.chunk_memory import chunked_need

    mem = chunks.memory
    detail = f"lowered in {mem.chunks}, each in a process of its own ({human(mem.converting)})"
    return chunked_need(chunks, "executorch export", detail, verify=verify, output=output, disk=disk)


class ExecuTorchExporter(GraphExporter):
    """One program the platform's runner loads (:mod:`moetool.export.executorch.runner_model`), its layers read and
    quantized one at a time; or, with ``--chunk-layers``, a chain of programs lowered a chunk of layers at a time."""

    name = "executorch"
    requires = "executorch"
    runtime_modules = ("executorch",)

    def check(self, req: ExportRequest) -> None:
        check_chunk_options(req)
        if chunk_layers(req) is None and req.options.get("jobs") is not None:
            raise ExportError(
                "--jobs: ExecuTorch lowers one program unless --chunk-layers cuts the model into several (a chain of "
                "programs that ExecuTorch's own LLM runner cannot load)"
            )

    def need(self, req: ExportRequest, plan: GraphPlan) -> Need:
        chunks = executorch_chunks(req, plan) if chunk_layers(req) is not None else runner_chunks(plan)
        return executorch_need(chunks, verify=req.verify, output=req.output, disk=plan.quant.total_bytes)

    def export(self, req: ExportRequest, plan: GraphPlan, console: Console | None = None) -> JsonObject:
        self.ready(req, plan)
        if chunk_layers(req) is None:
            from moetool.export.executorch.runner_export import export_runner_program

            return export_runner_program(req, plan, console)
        return self._export_chain(req, plan, console)

    def _export_chain(self, req: ExportRequest, plan: GraphPlan, console: Console | None) -> JsonObject:
        started = time.perf_counter()
        step = step_printer(console, started)
        chunks = executorch_chunks(req, plan)
        ranges = chunks.ranges
        counts = {"int8": 0, "int4": 0}
        notes: list[str] = []
        programs: list[JsonValue] = []
        moe_layers = 0
        with atomic_dir(req.output, force=req.force) as tmp:
            bounds = bounds_for(plan.context, int(plan.config.get("max_position_embeddings", plan.context)))
            lowered = _chunk_lowerer(req.model_dir, plan.precisions(), bounds, step, chunks.jobs)
            n = len(ranges)
            paths = [tmp / program_file(c, n) for c in range(n)]

            def lower_one(c: int, span: tuple[int, int]) -> dict[str, Any]:
                where = f"layers {span[0]}–{span[1] - 1}, program {c + 1} of {n}: " if n > 1 else ""
                return lowered(span, c == 0, c == n - 1, paths[c], where)

            if chunks.jobs > 1:
                step(f"lowering {n} programs, {chunks.jobs} at once")
            for span, path, result in zip(ranges, paths, run_chunks(ranges, lower_one, chunks.jobs), strict=True):
                counts = {k: counts[k] + int(result["quantized_linears"][k]) for k in counts}
                notes += result["notes"]
                moe_layers += int(result["moe_layers"])
                programs.append({"file": path.name, "layers": [span[0], span[1]]})
            parity: ParityRecord | str = NOT_VERIFIED
            if req.verify:
                step("checking the programs in executorch.runtime against transformers")
                parity = _verify(req, plan, paths)
            fields: JsonObject = {
                "runtime": "executorch.runtime, XNNPACK delegate",
                "export": "streamed: each chunk of decoder layers read from the checkpoint and lowered"
                + (" in a process of its own" if IN_CHILD else ", one at a time"),
                "methods": {
                    "forward": f"prefill of 2 to {bounds.prefill} tokens from an empty cache",
                    "decode": f"one token with KV cache, up to position {bounds.context - 1}",
                },
                "bounds": {"prefill": bounds.prefill, "context": bounds.context},
                "programs": programs,
                "jobs": chunks.jobs,
                "quantized_linears": {**counts},
                "moe_kernel": dense_moe_kernel("executorch", moe_layers),
            }
            files = {p.name: p for p in paths}
            manifest = finish_graph_manifest(
                tmp, "executorch", plan, files, paths[0].name, fields, parity=parity, started=started, notes=notes
            )
        return manifest


def _verify(req: ExportRequest, plan: GraphPlan, paths: list[Path]) -> ParityRecord:
    """The programs run in sequence (:func:`program_batch`) against transformers, held in float32 for a small model
    (with the whole float ExportLM over its weights as the conversion's own figure), else streamed from disk."""
    from moetool.export.reference import graph_reference

    ref = graph_reference(req.model_dir, plan.quant.total_params, plan.config)
    gate_as = "ExecuTorch (fp32)" if is_float_plan(plan) else None
    return reference_parity(req, ref, program_batch(paths), runtime="executorch (XNNPACK)", gate_as=gate_as)
