"""Run an edit: plan → (computed router rows) → stream into a temporary folder → parity check there → move into place,
then optionally recalibrate the routers. Nothing is left at the output unless every step succeeded."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class EditResult:
    """What an edit wrote and how it checked itself."""

    output: Path
    plan: EditPlan
    parity: dict[str, Any] = field(default_factory=dict)
    tuned: bool = False


def edit_need(plan: EditPlan, out: Path, *, verify: bool, tuned: bool) -> Need:
    """What writing ``plan`` needs: one tensor at a time (twice the largest) without the check; with it, the larger
    of input and output loaded once (they run one after the other); the output's bytes on disk (twice when the
    edited model is tuned into its final place)."""
    from moetool.compute.upcast import float32_overhead
    from moetool.eval.perplexity import eval_need

    sizes = [op.numel * SAFETENSORS_TAG_BYTES[op.dtype] for op in plan.ops]
    written = sum(sizes)
    if verify or tuned:
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


def check(plan: EditPlan, out: Path, *, device: str | None = None) -> dict[str, Any]:
    """The edit's parity figures (:mod:`moetool.edit.parity`), the output read from ``out``.

    Raises:
        EditError: a figure past the dtype's tolerance (the output is then not moved into place).
    """
    layout = plan.layout
    ids = parity.probe_ids(layout.path)
    tol = parity.TOLERANCE
    figures: dict[str, Any] = {"tokens": len(ids), "tolerance": tol}
    if plan.kind in ("remove", "prune"):
        allowed = {layer: [int(s) for s in slots] for layer, slots in plan.keep.items()}
        ref = parity.logits(layout.path, ids, allowed=allowed, device=device)
        figures["vs_input_restricted"] = parity.max_diff(parity.logits(out, ids, device=device), ref)
    elif plan.kind == "add":
        old = {layer: list(range(layout.n_experts)) for layer in layout.moe_layers}
        ref = parity.logits(layout.path, ids, device=device)
        figures["old_experts_vs_input"] = parity.max_diff(parity.logits(out, ids, allowed=old, device=device), ref)
        if not any("attention differs" in w for w in plan.warnings):
            new = {layer: [layout.n_experts] for layer in layout.moe_layers}
            ref = parity.logits(plan.sources["new"], ids, device=device)
            got = parity.logits(out, ids, allowed=new, silence_shared=True, device=device)
            figures["new_expert_vs_source"] = parity.max_diff(got, ref)
    elif plan.keep:  # extract of a routed expert
        ref = parity.logits(layout.path, ids, allowed=plan.keep, silence_shared=True, device=device)  # type: ignore[arg-type]
        figures["vs_input_one_expert"] = parity.max_diff(parity.logits(out, ids, device=device), ref)
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
    edit_need(plan, out, verify=verify and (device in (None, "auto", "cpu")), tuned=bool(steps)).check()

    def write(target: Path, overwrite: bool) -> None:
        with atomic_dir(target, force=overwrite) as tmp:
            stream(plan, tmp, computed or {}, console)
            write_metadata(plan, tmp)
            if verify:
                console.print(f"{plan.kind}: checking the output against the input …")
                result.parity = check(plan, tmp, device=device)
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
