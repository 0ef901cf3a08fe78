"""``moetool experts prune``: keep N experts per layer, chosen by REAP saliency, routing frequency or at random.

By default one set of experts is kept in every layer (named experts stay whole, ``extract`` still gives one back);
``per_layer`` lets each layer keep its own best N, as REAP does. Every config moetool writes holds one expert count for
all layers, so uneven per-layer budgets cannot be written (see docs/experts.md).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

import torch

from moetool.edit.layout import EditError, MoELayout
from moetool.edit.plan import EditPlan, Slot, select_plan
from moetool.edit.scoring import ExpertStats
from moetool.io.jsontypes import JsonObject

Criterion = Literal["reap", "frequency", "random"]
CRITERIA: tuple[Criterion, ...] = ("reap", "frequency", "random")


def budget(n_experts: int, keep: float, *, power_of_two: bool = False) -> int:
    """Experts to keep: ``keep`` itself when ≥ 1, else that fraction of ``n_experts`` (rounded); with
    ``power_of_two`` the largest power of two not above it (llama.cpp's GPU backends want one).

    Raises:
        EditError: a budget that is not a finite positive number, below 1 expert or not below the expert count.
    """
    if not math.isfinite(keep) or keep <= 0:  # int(nan) and int(inf) raise; a negative count keeps nothing
        raise EditError(f"--keep {keep}: give a number of experts (2, 3, …) or a fraction between 0 and 1")
    n = int(keep) if keep >= 1 else round(n_experts * keep)
    if keep >= 1 and keep != int(keep):
        raise EditError(f"--keep {keep}: give a whole number of experts, or a fraction below 1")
    if power_of_two and n >= 1:
        n = 1 << (n.bit_length() - 1)
    if n < 1:
        raise EditError(f"--keep {keep}: keeps no expert of {n_experts}")
    if n >= n_experts:
        raise EditError(f"--keep {keep}: the MoE has {n_experts} experts; pruning must keep fewer")
    return n


def scores(stats: ExpertStats, by: Criterion, *, seed: int = 0) -> torch.Tensor:
    """``[L, E]`` the score each expert is kept by (higher is kept first)."""
    if by == "reap":
        return stats.saliency().float()
    if by == "frequency":
        return stats.counts.float()
    g = torch.Generator().manual_seed(seed)
    return torch.rand(stats.counts.shape, generator=g)


def _global(score: torch.Tensor) -> torch.Tensor:
    """One score per expert over all layers: each layer's scores as shares of that layer's total, averaged, so every
    layer counts the same whatever its scale."""
    share = score / score.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return share.mean(0)


@dataclass
class PruneChoice:
    """Which experts each MoE layer keeps (slots in input order) and the scores behind it."""

    keep: dict[int, list[int]]
    score: torch.Tensor  # [L, E]
    by: Criterion
    per_layer: bool

    def report(self, layout: MoELayout) -> list[JsonObject]:
        """Per layer: kept and dropped experts with their scores, and the lowest score kept."""
        rows: list[JsonObject] = []
        for i, layer in enumerate(layout.moe_layers):
            kept = self.keep[layer]
            s = self.score[i] if self.per_layer else _global(self.score)
            rows.append(
                {
                    "layer": layer,
                    "kept": [layout.names[e] for e in kept],
                    "dropped": [layout.names[e] for e in range(layout.n_experts) if e not in kept],
                    "scores": {layout.names[e]: round(float(s[e]), 6) for e in range(layout.n_experts)},
                }
            )
        return rows


def choose(stats: ExpertStats, n: int, by: Criterion, *, per_layer: bool = False, seed: int = 0) -> PruneChoice:
    """The ``n`` experts each layer keeps by ``by``; ties go to the lower index."""
    score = scores(stats, by, seed=seed)
    if by == "random" and not per_layer:
        kept = sorted(random.Random(seed).sample(range(score.shape[1]), n))
        return PruneChoice(dict.fromkeys(stats.layers, kept), score, by, per_layer)
    if per_layer:
        keep = {
            layer: sorted(int(e) for e in torch.sort(score[i], descending=True, stable=True).indices[:n])
            for i, layer in enumerate(stats.layers)
        }
        return PruneChoice(keep, score, by, per_layer)
    order = torch.sort(_global(score), descending=True, stable=True).indices[:n]
    kept = sorted(int(e) for e in order)
    return PruneChoice(dict.fromkeys(stats.layers, kept), score, by, per_layer)


def prune_plan(layout: MoELayout, choice: PruneChoice, *, top_k: int | None, data: list[str]) -> EditPlan:
    """The MoE with ``choice``'s experts in each layer.

    Raises:
        EditError: fewer experts kept than ``top_k``.
    """
    n = len(next(iter(choice.keep.values())))
    k = top_k if top_k is not None else layout.top_k
    names = []
    for slot in range(n):
        origins = {layout.names[choice.keep[layer][slot]] for layer in layout.moe_layers}
        names.append(origins.pop() if len(origins) == 1 else f"slot{slot}")
    report = choice.report(layout)
    record = {
        "op": "prune",
        "source": str(layout.path.resolve()),
        "by": choice.by,
        "per_layer": choice.per_layer,
        "experts_before": layout.n_experts,
        "experts_after": n,
        "top_k": k,
        "calibration": data,
        "layers": report,
        "summary": f"pruned {layout.n_experts} → {n} experts per layer by {choice.by}"
        f"{' (each layer its own)' if choice.per_layer else ''}, top-{k}",
    }
    keep: dict[int, list[Slot]] = {layer: list(e) for layer, e in choice.keep.items()}
    return select_plan(layout, keep, kind="prune", names=names, top_k=k, record=record)
