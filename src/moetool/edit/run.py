"""Run an edit: plan → (computed router rows) → stream into a temporary folder → parity check there → move into place,
then optionally recalibrate the routers. Nothing is left at the output unless every step succeeded."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch
from rich.console import Console

from moetool.edit import parity
from moetool.edit.execute import check_not_input, stream, write_metadata
from moetool.edit.layout import EditError
from moetool.edit.plan import EditPlan
from moetool.edit.tune import Recalibration, data_files, recalibrate
from moetool.io.atomic import atomic_dir, check_output, scratch_dir
from moetool.io.budget import Need
from moetool.io.checkpoint import SAFETENSORS_TAG_BYTES
from moetool.progress import silent


class WriteOptions(TypedDict, total=False):
    """How every edit writes and checks its output (each key optional, at :func:`run`'s default)."""

    force: bool  # replace an existing output
    verify: bool  # check the output against the input before it moves into place (default True)
    dry_run: bool  # only the checks that read no weights; nothing written
    console: Console | None


class TuneOptions(WriteOptions, total=False):
    """What the edits that may recalibrate the routers take besides (their ``--data`` text apart)."""

    tune: Recalibration | None  # router recalibration after the edit (none without steps)
    dtype: str | None  # the precision the model computes in (auto: the checkpoint's own)
    device: str | None  # where it computes (auto: a GPU when there is one)


@dataclass
class EditResult:
    """What an edit wrote and how it checked itself."""

    output: Path
    plan: EditPlan
    parity: dict[str, Any] = field(default_factory=dict)
    tuned: bool = False


def edit_need(plan: EditPlan, out: Path, *, verify: bool, tuned: bool, streamed: bool = False) -> Need:
    """What writing ``plan`` needs: one tensor at a time (twice the largest) without the check; with it, the larger
    of input and output loaded once (they run one after the other), or, ``streamed``, one layer of them at a time;
    the output's bytes on disk (twice when the edited model is tuned into its final place)."""
    from moetool.compute.upcast import float32_overhead
    from moetool.eval.residency import eval_need

    sizes = [op.numel * SAFETENSORS_TAG_BYTES[op.dtype] for op in plan.ops]
    written = sum(sizes)
    if streamed and verify and not tuned:
        need = eval_need(plan.layout.path, dtype="auto", seq_len=128, batch_size=1, streamed=True)
        memory = max(need.memory, 2 * max(sizes, default=0) + (256 << 20))
        detail = f"{need.memory_detail}, to check the edit against its input (streamed from disk, layer by layer)"
    elif verify or tuned:
        need = eval_need(plan.layout.path, dtype="auto", seq_len=128, batch_size=1)
        grown = max(0, written - sum(i.nbytes for i in plan.layout.tensors.values()))  # an added expert
        # the check computes in float32: a 16-bit model holds one float32 layer and float32 embeddings beside it
        params = sum(i.numel for i in plan.layout.tensors.values())
        upcast = 0 if plan.layout.dtype == "F32" else float32_overhead(params, plan.layout.config)
        memory = need.memory + grown + upcast
        detail = f"{need.memory_detail}, to check the edit against its input (in float32, one layer at a time)"
    else:
        memory, detail = 2 * max(sizes, default=0) + (256 << 20), "two copies of the largest tensor, streamed"
    return Need(
        stage=f"experts {plan.kind}",
        memory=memory,
        memory_detail=detail,
        disk=written * (2 if tuned else 1),
        output=out,
        way_out="--no-check edits with one tensor in memory (the check loads the model); a GPU (--device cuda) runs "
        "the check in its own memory",
    )


def check_streams(plan: EditPlan, out: Path, *, verify: bool, tuned: bool) -> bool:
    """Whether the parity check must read the models one layer at a time from disk: the check runs (and no router
    recalibration, which trains the whole model), its resident need exceeds the memory available, and the streamed
    one does not."""
    from moetool.io.budget import available_memory

    if not verify or tuned:
        return False
    mem = available_memory()
    resident = edit_need(plan, out, verify=True, tuned=False)
    streamed = edit_need(plan, out, verify=True, tuned=False, streamed=True)
    return mem is not None and resident.memory > mem >= streamed.memory


def check(plan: EditPlan, out: Path, *, device: str | None = None, streamed: bool = False) -> dict[str, Any]:
    """The edit's parity figures (:mod:`moetool.edit.parity`), the output read from ``out``; ``streamed``, each
    model read from disk one layer at a time.

    Raises:
        EditError: a figure past the dtype's tolerance (the output is then not moved into place).
    """
    layout = plan.layout
    ids = parity.probe_ids(layout.path)
    tol = parity.TOLERANCE
    logits = functools.partial(parity.logits, device=device, streamed=streamed)
    figures: dict[str, Any] = {"tokens": len(ids), "tolerance": tol}
    if streamed:
        figures["held"] = "streamed from disk, one layer at a time"
    if plan.kind in ("remove", "prune"):
        allowed = {layer: [int(s) for s in slots] for layer, slots in plan.keep.items()}
        ref = logits(layout.path, ids, allowed=allowed)
        figures["vs_input_restricted"] = parity.max_diff(logits(out, ids), ref)
    elif plan.kind == "add":
        old = {layer: list(range(layout.n_experts)) for layer in layout.moe_layers}
        ref = logits(layout.path, ids)
        figures["old_experts_vs_input"] = parity.max_diff(logits(out, ids, allowed=old), ref)
        if not any("attention differs" in w for w in plan.warnings):
            new = {layer: [layout.n_experts] for layer in layout.moe_layers}
            ref = logits(plan.sources["new"], ids)
            got = logits(out, ids, allowed=new, silence_shared=True)
            figures["new_expert_vs_source"] = parity.max_diff(got, ref)
    elif plan.keep:  # extract of a routed expert
        ref = logits(layout.path, ids, allowed=plan.keep, silence_shared=True)  # type: ignore[arg-type]
        figures["vs_input_one_expert"] = parity.max_diff(logits(out, ids), ref)
    else:
        figures["note"] = "not checked: in the MoE the shared expert runs behind a sigmoid gate, alone it does not"
    worst = max((v for k, v in figures.items() if isinstance(v, float) and k not in ("tolerance",)), default=0.0)
    if not worst <= tol:
        raise EditError(
            f"{plan.kind}: parity check failed: max |Δlogit| {worst:.3g} > {tol:g} against the input "
            f"({json.dumps({k: v for k, v in figures.items() if isinstance(v, float)})}); nothing was written"
        )
    return figures


def run(
    plan: EditPlan,
    out: Path,
    *,
    computed: dict[str, torch.Tensor] | None = None,
    force: bool = False,
    console: Console | None = None,
    tune: Recalibration | None = None,
    data: dict[str, str] | None = None,
    verify: bool = True,
    dtype: str | None = None,
    device: str | None = None,
    dry_run: bool = False,
) -> EditResult:
    """Write ``plan`` to ``out`` (checked), then recalibrate its routers when ``tune.steps`` > 0; with ``dry_run``
    only the checks that read no weights run, and nothing is written.

    Raises:
        OutputExistsError: ``out`` exists and ``force`` is False (before any work).
        EditError: ``out`` overlaps an input, the parity check fails, or recalibration has no data.
    """
    console = console if console is not None else silent()
    out = Path(out)
    check_not_input(out, [*plan.sources.values(), *data_files(data)])  # -o over a --data file would replace it
    check_output(out, force=force)
    steps = tune.steps if tune is not None else 0
    if steps and not data:
        raise EditError("--tune-steps: router recalibration needs text: give --data NAME=FILE")
    for note in plan.warnings:
        console.print(f"[yellow]warning:[/] {note}")
    result = EditResult(out, plan)
    if dry_run:
        return result
    on_cpu = device in (None, "auto", "cpu")
    streamed = on_cpu and check_streams(plan, out, verify=verify, tuned=bool(steps))
    edit_need(plan, out, verify=verify and on_cpu, tuned=bool(steps), streamed=streamed).check()
    if streamed:
        console.print(
            f"{plan.kind}: the check reads the models from disk one layer at a time (they do not fit in memory)"
        )

    def write(target: Path, overwrite: bool) -> None:
        with atomic_dir(target, force=overwrite) as tmp:
            stream(plan, tmp, computed or {}, console)
            write_metadata(plan, tmp)
            if verify:
                console.print(f"{plan.kind}: checking the output against the input …")
                result.parity = check(plan, tmp, device=device, streamed=streamed)
                plan.record["parity"] = result.parity
                write_metadata(plan, tmp)

    if not steps:
        write(out, force)
        return result
    assert tune is not None and data is not None
    with scratch_dir(out, plan.kind) as scratch:
        edited = scratch / "edited"
        write(edited, False)
        console.print(f"recalibrating the routers ({steps} steps, every expert frozen) …")
        recalibrate(
            edited,
            out,
            data,
            tune,
            name=plan.layout.path.name,
            force=force,
            console=console,
            dtype=dtype,
            device=device,
        )
    result.tuned = True
    return result
