"""Bits by importance: a type per tensor ("bank") under a byte budget, from each bank's measured sensitivity.

Every bank starts at its cheapest candidate type; then, while the budget allows, the upgrade with the largest
loss reduction per extra byte is taken (over every bank and every higher type, so a bank can skip a step). A bank's
loss at a type is the model's KL divergence measured with that bank alone rounded to it; a candidate left
unmeasured (the near-lossless top of the ladder) is estimated from a measured one by the ratio of the
importance-weighted squared rounding errors (``Σ_e share_e Σ_ij imp_ej (W - Q_t(W))²``). Rounding error alone is
not the measure: on the real default, q4_1 has a fiftieth of q4_0's error and loses most of what fine-tuning added
(the base was dequantized from Q4_1, so q4_1's grid rounds each expert back onto the base).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moetool.quant.types import TYPES


@dataclass
class Bank:
    """One tensor the allocation decides, with its candidates.

    Attributes:
        name: the artifact's tensor name.
        role: its role (experts, attention, …).
        shape: torch shape.
        error: candidate type → importance-weighted squared rounding error (the proxy).
        kl: candidate type → measured KL divergence (mean per token, nats) with this bank alone at that type; a
            candidate without a measurement is estimated from the measured one nearest in error.
        probe: the cheapest candidate (always measured).
        share: for a stacked expert tensor, each expert's share of calibration tokens.
    """

    name: str
    role: str
    shape: tuple[int, ...]
    error: dict[str, float]
    kl: dict[str, float]
    probe: str
    share: list[float] = field(default_factory=list)

    def nbytes(self, t: str) -> int:
        return TYPES[t].nbytes(self.shape)

    def estimate(self, t: str) -> float:
        """KL at type ``t``: measured, else the measured candidate nearest in error scaled by the errors' ratio."""
        if t in self.kl:
            return max(0.0, self.kl[t])
        ref = min(self.kl, key=lambda m: abs(self.error[m] - self.error[t]))
        base = self.error.get(ref, 0.0)
        return 0.0 if base <= 0 else max(0.0, self.kl[ref]) * self.error[t] / base

    def candidates(self) -> list[str]:
        """Candidate types, cheapest first."""
        return sorted(self.error, key=lambda t: (self.nbytes(t), -TYPES[t].bits))


@dataclass
class Allocation:
    """The chosen type per bank, with the figures behind each choice."""

    budget: int
    fixed_bytes: int
    types: dict[str, str]
    banks: dict[str, Bank]
    steps: list[tuple[str, str, str, float]] = field(default_factory=list)  # bank, from, to, KL saved per MB

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + sum(self.banks[n].nbytes(t) for n, t in self.types.items())

    def why(self, name: str) -> str:
        """One line: why ``name`` got its type."""
        b, t = self.banks[name], self.types[name]
        cands = b.candidates()
        ups = [s for s in self.steps if s[0] == name]
        if ups:
            last = ups[-1]
            return f"raised to {t}: {last[3]:.3g} nats saved per MB, among the best of the budget's upgrades"
        if t == cands[-1]:
            return "its best candidate"
        nxt = cands[cands.index(t) + 1]
        gain = (b.estimate(t) - b.estimate(nxt)) / max(1, b.nbytes(nxt) - b.nbytes(t)) * 2**20
        low = f"; its experts' token shares {min(b.share):.2f}–{max(b.share):.2f}" if b.share else ""
        taken = min((s[3] for s in self.steps), default=0.0)
        if gain > taken:
            return f"kept at {t}: {nxt} ({gain:.3g} nats saved per MB) did not fit what was left of the budget{low}"
        return f"kept at {t}: {nxt} would save {gain:.3g} nats per MB, less than any upgrade taken{low}"

    def table(self) -> list[dict[str, Any]]:
        """One row per bank, in name order (for the manifest and the printed plan)."""
        rows = []
        for n in sorted(self.types):
            b, t = self.banks[n], self.types[n]
            rows.append(
                {
                    "tensor": n,
                    "role": b.role,
                    "type": t,
                    "bytes": b.nbytes(t),
                    "kl_measured": {k: round(v, 6) for k, v in b.kl.items()},
                    "kl_estimate": round(b.estimate(t), 6),
                    "expert_share": [round(s, 4) for s in b.share] or None,
                    "why": self.why(n),
                }
            )
        return rows


class BudgetTooSmall(ValueError):
    """Even the cheapest candidate of every bank does not fit the budget."""


def allocate(banks: list[Bank], budget: int, fixed_bytes: int) -> Allocation:
    """Types for ``banks`` whose bytes, with ``fixed_bytes`` (the tensors the plan pins), fit ``budget``.

    Raises:
        BudgetTooSmall: the cheapest types already exceed ``budget``, naming what the cheapest plan needs.
    """
    by_name = {b.name: b for b in banks}
    types = {b.name: b.candidates()[0] for b in banks}
    alloc = Allocation(budget, fixed_bytes, types, by_name)
    if alloc.total_bytes > budget:
        raise BudgetTooSmall(
            f"the cheapest plan needs {alloc.total_bytes / 1e6:.1f} MB, over the budget of {budget / 1e6:.1f} MB"
        )
    while True:
        room = budget - alloc.total_bytes
        best: tuple[float, str, str] | None = None
        for b in banks:
            cur = types[b.name]
            for t in b.candidates():
                extra = b.nbytes(t) - b.nbytes(cur)
                if extra <= 0 or extra > room:
                    continue
                gain = (b.estimate(cur) - b.estimate(t)) / extra
                if gain > 0 and (best is None or gain > best[0]):
                    best = (gain, b.name, t)
        if best is None:
            return alloc
        gain, name, t = best
        alloc.steps.append((name, types[name], t, gain * 2**20))
        types[name] = t
