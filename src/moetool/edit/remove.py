"""``moetool experts remove`` and ``extract``: exact edits that read no calibration text."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from moetool.edit.layout import EditError, MoELayout, read_layout
from moetool.edit.plan import EditPlan, Slot, extract_plan, select_plan


def remove_plan(layout: MoELayout, refs: list[str], *, top_k: int | None = None) -> EditPlan:
    """The MoE without the experts ``refs`` (names or indices) in every MoE layer; every other tensor bit for bit.

    Raises:
        EditError: an unknown expert, all of them removed, or fewer left than ``top_k``.
    """
    if not refs:
        raise EditError("name at least one expert to remove")
    gone = sorted({layout.resolve(r) for r in refs})
    kept = [e for e in range(layout.n_experts) if e not in gone]
    if not kept:
        raise EditError(f"{layout.path}: removing {', '.join(refs)} would leave no expert")
    k = top_k if top_k is not None else layout.top_k
    names = [layout.names[e] for e in kept]
    removed = [layout.names[e] for e in gone]
    record = {
        "op": "remove",
        "source": str(layout.path.resolve()),
        "removed": removed,
        "experts_before": layout.n_experts,
        "experts_after": len(kept),
        "top_k": k,
        "summary": f"removed {', '.join(removed)} ({layout.n_experts} → {len(kept)} experts, top-{k})",
    }
    keep: dict[int, list[Slot]] = {layer: list(kept) for layer in layout.moe_layers}
    return select_plan(layout, keep, kind="remove", names=names, top_k=k, record=record)


def extract(path: Path, ref: str) -> EditPlan:
    """The plan of expert ``ref`` (a name, an index, or ``shared``) as a dense model.

    Raises:
        EditError: not an MoE, or no such expert.
    """
    layout = read_layout(path)
    slot: int | Literal["shared"] = (
        "shared" if ref == "shared" and "shared" not in layout.names else layout.resolve(ref)
    )
    record = {"op": "extract", "source": str(layout.path.resolve())}
    plan = extract_plan(layout, slot, record)
    plan.record["summary"] = f"expert {plan.record['expert']} of {layout.path.name} as a dense model"
    return plan
