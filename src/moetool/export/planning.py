"""Choosing a precision plan for a target and a device (shared by every exporter)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetool import __version__
from moetool.export.base import ArtifactPlan, ExportError, ExportRequest
from moetool.export.heldout import model_name
from moetool.io.checkpoint import Checkpoint
from moetool.io.hashes import sha256_file
from moetool.quant.devices import MemoryEstimate, estimate_memory, get_device
from moetool.quant.plan import QuantPlan, QuantSpec, TensorEntry, UnmatchedRuleError, resolve


def manifest_base(target: str, plan: ArtifactPlan, files: dict[str, Path], main: str) -> dict[str, Any]:
    """The manifest fields every artifact has: files with sizes and hashes, the source weights' hashes, the device,
    the memory estimate, the plan and its notes. Exporters add their runtime, parity and timing."""

    origin = {} if plan.origin is None else {plan.origin.key: plan.origin.to_json()}
    return {
        "format": "moetool-artifact/1",
        "target": target,
        "file": main,
        "files": {n: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for n, p in files.items()},
        "model": {
            "name": plan.name,
            "path": str(plan.model_dir if plan.origin is None else plan.origin.path),
            "model_type": plan.config.get("model_type"),
            "weights_sha256": {f.name: sha256_file(f) for f in Checkpoint(plan.model_dir).weight_files},
        },
        "artifact": {"bytes": sum(p.stat().st_size for p in files.values()), "sha256": sha256_file(files[main])},
        "device": plan.device,
        "memory_estimate": None
        if plan.memory is None
        else {
            "context": plan.context,
            "weights": plan.memory.weights,
            "kv_cache": plan.memory.kv_cache,
            "runtime": plan.memory.runtime,
            "total": plan.memory.total,
        },
        "plan": plan.quant.to_json(),
        "notes": plan.quant.notes(),
        "moetool": __version__,
        **origin,
    }


@dataclass
class PlanChoice:
    quant: QuantPlan
    memory: MemoryEstimate
    context: int
    device: str | None = None
    candidates: list[tuple[str, int, bool]] = field(default_factory=list)  # (plan, estimate, fits)

    def plan_fields(self, req: ExportRequest, config: dict[str, Any]) -> dict[str, Any]:
        """The :class:`ArtifactPlan` fields of this choice for ``req`` (a target's plan class adds its own)."""
        return {
            "model_dir": req.model_dir,
            "config": config,
            "quant": self.quant,
            "name": model_name(req.named_model),
            "device": self.device,
            "memory": self.memory,
            "context": self.context,
            "candidates": self.candidates,
            "origin": req.origin,
            "options": dict(req.options),
        }


def choose_plan(
    req: ExportRequest,
    entries: list[TensorEntry],
    config: dict[str, Any],
    fmt: str,
    *,
    precision_of: Callable[[str], str] = lambda t: t,
    cannot: dict[str, str] | None = None,
    fit_rows: bool = True,
) -> PlanChoice:
    """The request's plan, or with ``--for`` (a profile) and no plan the first of the device's ladder that fits.

    ``precision_of`` maps a plan type to the name the device profile lists for ``fmt`` (a GGUF type, or fp32/int8/
    int4 for graph formats); types the target cannot store at all raise ``ValueError`` there.

    Raises:
        ExportError: a type the target cannot store, a rule of the user's plan that matches no tensor, or no plan
            within the device's budget (with every estimate).
    """

    def resolve_checked(spec: QuantSpec) -> QuantPlan:
        try:
            q = resolve(spec, entries, cannot=cannot, fit_rows=fit_rows)
        except UnmatchedRuleError as exc:
            raise ExportError(f"plan {spec.label()!r} for {fmt}: {exc}") from None
        try:
            for a in q.assignments:
                precision_of(a.type)
        except ValueError as exc:
            raise ExportError(f"plan {q.label!r} for {fmt}: {exc}") from None
        return q

    if req.device is None:
        ctx = req.context or 2048
        q = resolve_checked(req.quant)
        return PlanChoice(q, estimate_memory(q.total_bytes, config, ctx), ctx)
    device = get_device(req.device)
    ctx = req.context or device.context
    user_plan = req.quant.preset is not None or bool(req.quant.rules) or req.quant.default is not None
    ladder = [req.quant] if user_plan else [QuantSpec(preset=p) for p in device.ladder]
    candidates: list[tuple[str, int, bool]] = []
    chosen: PlanChoice | None = None
    for spec in ladder:
        try:
            q = resolve_checked(spec)
        except ExportError:
            if user_plan:
                raise
            continue
        mem = estimate_memory(q.total_bytes, config, ctx)
        fits = mem.total <= device.budget and all(device.supports(fmt, precision_of(a.type)) for a in q.assignments)
        candidates.append((q.label, mem.total, fits))
        if fits and chosen is None:
            chosen = PlanChoice(q, mem, ctx, device.name)
    if chosen is None:
        rows = "; ".join(f"{lbl}: {tot / 1e9:.2f} GB" for lbl, tot, _ in candidates)
        raise ExportError(
            f"no plan fits {device.name} as {fmt} (budget {device.budget / 1e9:.2f} GB at {ctx} tokens of context, "
            f"precisions {', '.join(device.precisions.get(fmt, ()))}): {rows}"
        )
    chosen.candidates = candidates
    return chosen
