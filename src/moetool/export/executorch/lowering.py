"""ExecuTorch programs lowered to XNNPACK after torchao quantizes their weights per the plan: the runner program
(:func:`lower_runner`: every layer, ``forward(tokens, input_pos)`` with the cache inside, the weights in
``model.ptd``) or one chunk of a chain (:func:`lower_chunk`: some decoder layers, methods ``forward`` and ``decode``).
The exporter runs each here in a process of its own:

    python -m moetool.export.executorch.lowering REQUEST.json

REQUEST has ``model_dir``, ``precisions`` (export name → fp32|int8|int4), ``prefill`` and ``context``
(:class:`Bounds`); for the runner program ``runner`` (its metadata methods) and ``out_dir``; for a chunk ``layers``
``[start, stop)``, ``first`` and ``last`` (whether the chunk embeds the tokens and computes the logits) and ``path``
(the program to write). The result printed: ``quantized_linears`` (counts), ``notes`` and ``moe_layers`` (MoE
blocks lowered).

Why a process per chunk: ``torch.export`` and the lowering leave state allocated after the program is written (FX
graph modules torch keeps reachable: 274 alive after three chunks; neither ``gc``, ``malloc_trim`` nor
``torch._dynamo.reset()`` frees them), about 0.21 GB per two-layer chunk of the size ladder's 360M rung, 8.64 GB over
its 16 chunks in one process. A process's exit gives it all back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moetool.export.graph.chunk import ExportChunk
from moetool.export.graph.model import DenseMaskedMoE, ExportLM, causal_mask, prefill_inputs
from moetool.progress import Step

if TYPE_CHECKING:
    from torch import nn
    from torch.export import ExportedProgram

    from moetool.export.executorch.runner_model import RunnerLM
    from moetool.export.graph.stream import StreamedExport

__all__ = [
    "PREFILL_MAX",
    "Bounds",
    "bounds_for",
    "export_programs",
    "lower",
    "lower_chunk",
    "lower_runner",
    "quantize_modules",
    "write_runner_program",
]


def _first_input(model: ExportLM | ExportChunk, t: int) -> torch.Tensor:
    """An example of the model's first input over ``t`` positions: token ids, or a chunk's hidden states."""
    if getattr(model, "first", True):
        return torch.randint(0, 10, (1, t))
    return torch.zeros(1, t, int(getattr(model, "hidden_size", 0)))


@dataclass(frozen=True)
class Bounds:
    """The longest prefill ``forward`` takes and the positions ``decode`` reaches (``context``: past + 1 at most).

    ExecuTorch plans every activation's memory for the largest shape a method allows, and the program allocates it
    when the method loads: a prefill of up to 4,096 tokens planned 2.4 GB per program of the size ladder's 360M rung
    (15 heads' 4,096 × 4,096 attention scores), 3.4 GB once run. A bound keeps that to what the device needs.
    """

    prefill: int
    context: int


# the longest prefill by default: attention scores of 512 × 512 per head; a longer prompt goes on through decode
PREFILL_MAX = 512


def bounds_for(context: int, max_positions: int) -> Bounds:
    """The bounds of a model of ``max_positions`` positions deployed at ``context`` tokens."""
    ctx = max(8, min(context, max_positions))
    return Bounds(prefill=min(PREFILL_MAX, ctx), context=ctx)


def export_programs(model: ExportLM | ExportChunk, bounds: Bounds) -> tuple[ExportedProgram, ExportedProgram]:
    """torch.export both methods within ``bounds`` (strict tracing: the non-strict path adds stride guards it then
    rejects)."""

    seq = torch.export.Dim("seq", min=2, max=bounds.prefill)
    _, pos, mask = prefill_inputs(torch.zeros(1, 8, dtype=torch.long))
    pre = torch.export.export(
        model,
        (_first_input(model, 8), pos, mask),
        dynamic_shapes=({1: seq}, {1: seq}, {2: seq, 3: seq}),
        strict=True,
    )
    past_len = torch.export.Dim("past", min=1, max=bounds.context - 1)
    p = 5
    past = [torch.zeros(1, model.n_kv, p, model.head_dim) for _ in range(2 * model.n_layers)]
    dec = torch.export.export(
        model,
        (_first_input(model, 1), torch.tensor([[p]]), causal_mask(1, p), *past),
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


def lower(model: ExportLM | ExportChunk, bounds: Bounds, step: Step | None = None) -> bytes:
    """Both methods of ``model`` lowered to XNNPACK within ``bounds``: the ``.pte`` program's bytes."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    step = step or (lambda what: None)
    step("torch.export: the prefill and decode methods")
    pre, dec = export_programs(model, bounds)
    step(f"lowering {len(pre.graph.nodes) + len(dec.graph.nodes):,} graph nodes to XNNPACK (the slow step)")
    prog = to_edge_transform_and_lower({"forward": pre, "decode": dec}, partitioner=[XnnpackPartitioner()])
    step("serializing the program")
    buffer: bytes = prog.to_executorch().buffer
    return buffer


def lower_chunk(
    src: StreamedExport,
    layers: tuple[int, int],
    ends: tuple[bool, bool],
    *,
    precisions: dict[str, str],
    path: Path,
    bounds: Bounds,
    step: Step | None = None,
) -> dict[str, Any]:
    """Layers ``[start, stop)`` of ``src`` read, quantized (their float weights dropped at once), lowered and written
    to ``path``; ``ends``: (the first chunk, the last chunk). Returns the result the module docstring names."""
    step = step or (lambda what: None)
    blocks = {i: src.block(i) for i in range(*layers)}
    chunk = ExportChunk(src.em, blocks, first=ends[0], last=ends[1]).eval()
    if any(p != "fp32" for p in precisions.values()):
        step("quantizing the linear layers with torchao")
    counts, notes = quantize_modules(chunk, precisions)
    for i in range(*layers):  # the quantized weights replace the float ones, which can go now
        src.drop(i)
    moe_layers = sum(isinstance(b.mlp, DenseMaskedMoE) for b in blocks.values())
    path.write_bytes(lower(chunk, bounds, step))
    return {"quantized_linears": counts, "notes": notes, "moe_layers": moe_layers}


def write_runner_program(
    model: RunnerLM, bounds: Bounds, metadata: dict[str, Any], out_dir: Path, step: Step | None = None
) -> tuple[Path, Path]:
    """``model`` exported (``tokens`` dynamic up to ``bounds.prefill``, ``input_pos`` a static [1]), lowered to
    XNNPACK with ``metadata`` as constant methods, and written as ``model.pte`` with every weight in ``model.ptd``
    (program–data separation: the runner's ``data_path``). Returns both paths."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    step = step or (lambda what: None)
    tokens = torch.export.Dim("tokens", min=1, max=bounds.prefill)
    example = (torch.zeros(1, 3, dtype=torch.long), torch.tensor([0]))
    shapes = ({1: tokens}, None)
    model.reset()
    step("torch.export: forward(tokens, input_pos) with the KV cache inside")
    with torch.no_grad():
        # torchao's quantized weights flattened to plain tensors first, so the tagging below reaches them
        ep = torch.export.export(model, example, dynamic_shapes=shapes, strict=False).run_decompositions({})
        unlifted = ep.module()
        delegate_external_constants_pass_unlifted(module=unlifted, gen_tag_fn=lambda node: "model")
        ep = torch.export.export(unlifted, example, dynamic_shapes=shapes, strict=False)
        del unlifted
    step(f"lowering {len(ep.graph.nodes):,} graph nodes to XNNPACK (the slow step)")
    edge = to_edge_transform_and_lower(
        ep,
        partitioner=[XnnpackPartitioner()],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods=metadata,
    )
    del ep
    step("serializing the program and its weights")
    program = edge.to_executorch(
        ExecutorchBackendConfig(
            extract_delegate_segments=True,
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
            # memory planned for the longest prefill, not for the example's 3 tokens
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
            external_constants=lambda node: "model",  # what XNNPACK does not take (the embedding, rope) too
        )
    )
    del edge
    pte = out_dir / "model.pte"
    with pte.open("wb") as f:
        program.write_to_file(f)
    program.write_tensor_data_to_file(str(out_dir))
    return pte, out_dir / "model.ptd"


def lower_runner(
    src: StreamedExport,
    *,
    precisions: dict[str, str],
    out_dir: Path,
    bounds: Bounds,
    metadata: dict[str, Any],
    step: Step | None = None,
) -> dict[str, Any]:
    """Every layer of ``src`` read, quantized per the plan and its float weights dropped one layer at a time (the
    float model is never held), then the whole :class:`RunnerLM` lowered into ``out_dir`` (``model.pte`` and
    ``model.ptd``); returns the result the module docstring names."""
    from moetool.export.executorch.runner_model import RunnerLM

    step = step or (lambda what: None)
    model = RunnerLM(src.em, bounds.context).eval()
    ends = {n: p for n, p in precisions.items() if not n.startswith("layers.")}
    counts, notes = quantize_modules(model, ends)  # the head (the embedding is a lookup torchao leaves float)
    step(f"reading and quantizing {src.n_layers} decoder layers, one at a time")
    for i in range(src.n_layers):
        model.add(i, src.block(i))
        own = {n: p for n, p in precisions.items() if n.startswith(f"layers.{i}.")}
        more, why = quantize_modules(model, own)
        counts = {k: counts[k] + more[k] for k in counts}
        notes += why
        src.drop(i)  # the quantized weights replace the float ones, which can go now
    moe_layers = sum(isinstance(getattr(b, "mlp", None), DenseMaskedMoE) for b in model.layers.values())
    write_runner_program(model, bounds, metadata, out_dir, step)
    return {"quantized_linears": counts, "notes": notes, "moe_layers": moe_layers}


def _lowered(request: dict[str, Any]) -> dict[str, Any]:
    """The worker: the request's chunk (or, with ``runner``, the whole runner program) read from its checkpoint
    (only the weights it needs besides its layers)."""
    from moetool.export.graph.stream import streamed_export_model

    if "runner" in request:
        return lower_runner(
            streamed_export_model(Path(request["model_dir"])),
            precisions=request["precisions"],
            out_dir=Path(request["out_dir"]),
            bounds=Bounds(prefill=int(request["prefill"]), context=int(request["context"])),
            metadata=request["runner"],
        )
    start, stop = request["layers"]
    return lower_chunk(
        streamed_export_model(Path(request["model_dir"])),
        (int(start), int(stop)),
        (bool(request["first"]), bool(request["last"])),
        precisions=request["precisions"],
        path=Path(request["path"]),
        bounds=Bounds(prefill=int(request["prefill"]), context=int(request["context"])),
    )


if __name__ == "__main__":
    from moetool.export.worker import worker_main

    worker_main(_lowered)
