"""``moetool export --target tflite``: ExportLM with a static KV cache → ``.tflite`` models with ``prefill`` and
``decode`` signatures (litert-torch), int8/int4 by role through ai-edge-quantizer, parity in the LiteRT interpreter.

Streamed, in chunks: the model is never held whole. Each chunk of consecutive decoder layers is read from the
checkpoint, converted and quantized in a process of its own, in litert-torch's interpreter
(:mod:`moetool.export.tflite.worker`), and written as its own model; a model whose layers fit one chunk is one
``model.tflite`` in LiteRT-LM's layout (``tokens`` in, ``logits`` out; :mod:`moetool.export.tflite.litertlm`) and
the same model bundled as ``model.litertlm`` that LiteRT-LM generates from (checked against transformers'
greedy text, :mod:`moetool.export.tflite.bundle`), a larger one ``model_chunk00.tflite`` … run in sequence, hidden
states passed on, each chunk's KV cache its own inputs and outputs. The check runs the chunks one at a time in the
LiteRT interpreter (:mod:`moetool.export.tflite.chain_worker`) against transformers here.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moetool.export.base import ExportError, ExportRequest
from moetool.export.graph.chunk import chunk_layers
from moetool.export.graph.chunk_memory import ChunkPlan, Multiples, check_chunk_options, chunked_memory, plan_chunks
from moetool.export.graph.common import GraphPlan, plan_graph
from moetool.export.graph.jobs import run_chunks, worker_env
from moetool.export.graph.moe_kernel import dense_moe_kernel
from moetool.export.parity import NOT_VERIFIED, ParityRecord
from moetool.export.pipeline_steps import GraphExporter, finish_graph_manifest, is_float_plan, reference_parity
from moetool.export.tflite.bundle import BUNDLE, NO_BUNDLE, RUNNER, bundle_tokens, litert_lm_missing, runner_check
from moetool.export.tflite.runner import REPO, litert_python, run_worker
from moetool.export.tflite.worker import role_precisions
from moetool.io.atomic import atomic_dir
from moetool.io.budget import Need, human
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.progress import step_printer

if TYPE_CHECKING:
    from rich.console import Console

    from moetool.export.graph.parity import Batch, Call
    from moetool.export.reference import GraphReference

__all__ = ["REPO", "TFLiteExporter", "litert_python"]  # REPO, litert_python: kept importable here for older callers

# decoder layers' float32 weights per model, by default (litert-torch's conversion holds a chunk several times over)
CHUNK_BYTES = 256 << 20
# peak RSS of one conversion (its own process) over the float32 bytes of each tensor it converts, above the runtime
# and the weights outside the layers, at any plan (the quantizer rewrites the converted file): two middle layers of
# the size ladder's 360M rung (256 MB of float32) peaked at 2.11 GB (4.4x); the 1.7B rung's one-layer models at
# moe-q4 (2026-11-29) a middle one 5.20 GB (4.9x), the first 6.01 GB (the float32 embedding 2.0x), the last 6.41 GB
# (the int8 head 3.0x)
CONVERT_MULTIPLES = Multiples(5.8, None, (("embed.weight", 2.5), ("lm_head.weight", 3.5)))
RUNTIME = 512 << 20  # torch and litert-torch in the converting process, torch in this one


def chunk_file(index: int, count: int) -> str:
    """The model name of chunk ``index`` of ``count``: ``model.tflite`` when the model is one chunk."""
    return "model.tflite" if count == 1 else f"model_chunk{index:02d}.tflite"


def static_shape(plan: GraphPlan) -> tuple[int, int]:
    """(cache capacity, prefill length) of the converted signatures: up to 512 slots, a 128-token prefill."""
    max_pos = int(plan.config.get("max_position_embeddings", 2048))
    capacity = min(max_pos, plan.context, 512)
    return capacity, min(128, capacity - 8)


def tflite_chunks(req: ExportRequest, plan: GraphPlan) -> ChunkPlan:
    """The models of ``plan`` and how many are converted at once: without ``--chunk-layers``, one model when its one
    conversion fits the available memory (the only form LiteRT-LM runs: one decoder model), else
    :func:`moetool.export.graph.chunk_memory.plan_chunks`'s chunks. A conversion (in a process of its own) holds each
    tensor it converts :data:`CONVERT_MULTIPLES` times, beside the weights outside the layer stack its reader keeps."""
    from moetool.io.budget import available_memory

    if chunk_layers(req) is None:
        whole = [(0, int(plan.config["num_hidden_layers"]))]
        one = chunked_memory(plan, whole, multiples=CONVERT_MULTIPLES, runtime=RUNTIME, piece="model")
        mem = available_memory()
        if mem is None or one.peak(req.verify) <= mem:
            return ChunkPlan(whole, one)
    return plan_chunks(req, plan, CHUNK_BYTES, multiples=CONVERT_MULTIPLES, runtime=RUNTIME, piece="model")


def tflite_need(chunks: ChunkPlan, *, verify: bool, output: Path, disk: int) -> Need:
    """Memory and disk of a TFLite export in ``chunks`` (:func:`tflite_chunks`): ``jobs`` conversions at once;
    verification holds the transformers reference (in float32 or streamed) here beside one chunk in the
    interpreter."""
    from moetool.export.graph.chunk_memory import chunked_need

    mem = chunks.memory
    detail = f"converted in {mem.chunks} ({human(mem.converting)})"
    return chunked_need(chunks, "tflite export", detail, verify=verify, output=output, disk=disk)


class TFLiteExporter(GraphExporter):
    """Streamed: converted a chunk of decoder layers at a time from the checkpoint; the model is never held whole."""

    name = "tflite"
    requires = "tflite"

    def plan(self, req: ExportRequest) -> GraphPlan:
        plan = plan_graph(req, "tflite")
        try:
            role_precisions(plan.precisions())
        except ValueError as exc:
            raise ExportError(str(exc)) from None
        return plan

    def check(self, req: ExportRequest) -> None:
        litert_python()  # no litert-torch: refuse before anything is written
        check_chunk_options(req)

    def need(self, req: ExportRequest, plan: GraphPlan) -> Need:
        chunks = tflite_chunks(req, plan)
        # a model of one chunk is written twice: model.tflite, and inside model.litertlm
        disk = plan.quant.total_bytes * (2 if len(chunks.ranges) == 1 else 1)
        return tflite_need(chunks, verify=req.verify, output=req.output, disk=disk)

    def export(self, req: ExportRequest, plan: GraphPlan, console: Console | None = None) -> JsonObject:
        self.ready(req, plan)
        started = time.perf_counter()
        step = step_printer(console, started)
        chunks = tflite_chunks(req, plan)
        ranges = chunks.ranges
        capacity, prefill_len = static_shape(plan)
        roles: dict[str, JsonValue] = {}
        notes: list[str] = []
        moe_layers = 0
        env = worker_env(chunks.jobs)
        with atomic_dir(req.output, force=req.force) as tmp:
            n = len(ranges)
            paths = [tmp / chunk_file(c, n) for c in range(n)]
            bundle, litertlm = _bundle_plan(req, tmp, n, capacity)

            def convert_one(c: int, span: tuple[int, int]) -> dict[str, Any]:
                where = f"layers {span[0]}–{span[1] - 1}, model {c + 1} of {n}: " if n > 1 else ""
                step(f"{where}converting with litert-torch, in its own interpreter")
                request = {"model_dir": str(req.model_dir), "layers": list(span), "first": c == 0, "last": c == n - 1}
                request |= {"path": str(paths[c]), "precisions": plan.precisions()}
                request |= {"capacity": capacity, "prefill_len": prefill_len}
                if n == 1:  # the whole model: in LiteRT-LM's layout, and bundled when it can be
                    request |= {"litertlm": True} | ({"bundle": bundle} if bundle else {})
                return run_worker("moetool.export.tflite.worker", request, env=env)

            if chunks.jobs > 1:
                step(f"converting {n} models, {chunks.jobs} at once")
            for result in run_chunks(ranges, convert_one, chunks.jobs):
                roles |= result["quantized_roles"]
                notes += [x for x in result["tflite_notes"] if x not in notes]
                moe_layers += int(result["moe_layers"])
            models: list[JsonValue] = [
                {"file": p.name, "layers": [a, b]} for p, (a, b) in zip(paths, ranges, strict=True)
            ]
            parity: ParityRecord | str = NOT_VERIFIED
            runner: JsonValue = NOT_VERIFIED if bundle else litertlm["why"]
            if req.verify:
                from moetool.export.reference import graph_reference

                ref = graph_reference(req.model_dir, plan.quant.total_params, plan.config)
                step("checking the models in the LiteRT interpreter against transformers")
                parity = _verify(req, plan, paths, capacity, prefill_len, ref)
                if bundle:
                    step(f"generating from {BUNDLE} in LiteRT-LM against transformers")
                    runner = runner_check(tmp / BUNDLE, req.model_dir, ref.model, capacity, judge=is_float_plan(plan))
            n_kv = int(plan.config.get("num_key_value_heads") or plan.config["num_attention_heads"])
            head_dim = int(
                plan.config.get("head_dim") or plan.config["hidden_size"] // plan.config["num_attention_heads"]
            )
            fields: JsonObject = {
                "runtime": "LiteRT (ai_edge_litert interpreter, XNNPACK)",
                "export": "streamed: each chunk of decoder layers read from the checkpoint and converted in a process "
                "of its own",
                "signatures": {
                    "prefill" if n > 1 else f"prefill_{prefill_len}": f"{prefill_len} tokens (right-padded)",
                    "decode": "1 token",
                },
                "kv_cache": f"explicit inputs/outputs, capacity {capacity}",
                "chunks": models,
                "jobs": chunks.jobs,
                "quantized_roles": roles,
                "capacity": capacity,
                "prefill_len": prefill_len,
                "tflite_notes": list(notes),
                "cache_shape": [1, n_kv, capacity, head_dim],
                "cache_tensors": 2 * int(plan.config["num_hidden_layers"]),
                "moe_kernel": dense_moe_kernel("tflite", moe_layers),
                "litertlm": litertlm,
                "runner": runner,
            }
            files = {p.name: p for p in paths} | ({BUNDLE: tmp / BUNDLE} if bundle else {})
            manifest = finish_graph_manifest(
                tmp, "tflite", plan, files, paths[0].name, fields, parity=parity, started=started
            )
        return manifest


def interpreter_batch(paths: list[Path], capacity: int, prefill_len: int) -> Batch:
    """Every parity call through the models at ``paths`` in sequence in the LiteRT interpreter, one at a time
    (:mod:`moetool.export.tflite.chain_worker`, in litert-torch's interpreter). The calls and logits pass through
    ``.npz`` files beside the models, in the output's temporary folder: a killed run's (up to 0.4 GB at the 360M
    rung) is swept with that folder by the next run (:mod:`moetool.io.atomic`), not left in ``$TMPDIR``."""

    def run_all(calls: list[Call]) -> list[np.ndarray]:
        with tempfile.TemporaryDirectory(prefix=".tflite-check-", dir=paths[0].parent) as work:
            given, out = Path(work) / "calls.npz", Path(work) / "logits.npz"
            np.savez(given, *[ids for ids, _ in calls])
            request = {"paths": [str(p) for p in paths], "capacity": capacity, "prefill_len": prefill_len}
            request |= {"calls": str(given), "positions": [pos for _, pos in calls], "out": str(out)}
            run_worker("moetool.export.tflite.chain_worker", request, what="the LiteRT check")
            with np.load(out) as saved:
                return [saved[f"arr_{j}"] for j in range(len(calls))]

    return run_all


def _bundle_plan(req: ExportRequest, tmp: Path, n: int, capacity: int) -> tuple[JsonObject | None, JsonObject]:
    """(the worker's ``bundle`` request, or None; the manifest's ``litertlm`` record): a model of one chunk with a
    ``tokenizer.json`` is bundled, anything else says why not."""
    if n > 1:
        return None, {"file": None, "why": NO_BUNDLE.format(n=n)}
    lacking = litert_lm_missing()
    if lacking:
        why = f"not written: {', '.join(lacking)} not installed beside litert-torch (bash scripts/setup.sh --tflite)"
        return None, {"file": None, "why": why}
    tokenizer = req.model_dir / "tokenizer.json"
    if not tokenizer.is_file():
        return None, {"file": None, "why": f"not written: {req.model_dir} has no tokenizer.json (LiteRT-LM reads it)"}
    start, stop = bundle_tokens(req.model_dir)
    ids: JsonObject = {"start_ids": list[JsonValue](start), "stop_ids": list[JsonValue](stop)}
    bundle: JsonObject = {"path": str(tmp / BUNDLE), "tokenizer": str(tokenizer), **ids}
    record: JsonObject = {"file": BUNDLE, "runtime": RUNNER, "model": "model.tflite (PREFILL_DECODE)", **ids}
    return bundle, record | {"max_num_tokens": capacity}


def _verify(
    req: ExportRequest, plan: GraphPlan, paths: list[Path], capacity: int, prefill_len: int, ref: GraphReference
) -> ParityRecord:
    """The models run in sequence (:func:`interpreter_batch`) against ``ref`` (transformers), held in float32 for a
    small model (with the whole float ExportLM over its weights as the conversion's own figure), else streamed from
    disk."""
    batch = interpreter_batch(paths, capacity, prefill_len)
    gate_as = "TFLite (fp32)" if is_float_plan(plan) else None
    return reference_parity(
        req, ref, batch, runtime="ai_edge_litert interpreter", gate_as=gate_as, seq_lens=(32, prefill_len)
    )
