"""The bit allocation's greedy choice, on banks whose costs are given (no model)."""

from __future__ import annotations

import pytest

from moetool.quant.allocate import Bank, BudgetTooSmall, allocate
from moetool.quant.types import TYPES

SHAPE = (256, 1024)


def _bank(name: str, kl: dict[str, float], share: list[float] | None = None) -> Bank:
    error = {t: v for t, v in kl.items()}  # the proxy only fills unmeasured candidates
    return Bank(name, "experts", SHAPE, error, dict(kl), min(kl, key=lambda t: TYPES[t].nbytes(SHAPE)), share or [])


def nb(t: str) -> int:
    return TYPES[t].nbytes(SHAPE)


def test_the_budget_goes_where_a_byte_saves_the_most():
    sensitive = _bank("a", {"q2_k": 1.0, "q4_k": 0.1, "q8_0": 0.001})
    robust = _bank("b", {"q2_k": 0.02, "q4_k": 0.01, "q8_0": 0.0})
    budget = nb("q4_k") + nb("q2_k")
    alloc = allocate([sensitive, robust], budget, fixed_bytes=0)
    assert alloc.types == {"a": "q4_k", "b": "q2_k"} and alloc.total_bytes <= budget
    assert "raised to q4_k" in alloc.why("a") and "kept at q2_k" in alloc.why("b")
    roomy = allocate([sensitive, robust], 2 * nb("q8_0"), fixed_bytes=0)
    assert roomy.types == {"a": "q8_0", "b": "q8_0"}


def test_a_costlier_type_that_measures_worse_is_never_taken():
    """q4_1 on the real default: less rounding error, more KL (it rounds the experts back onto the base)."""
    b = _bank("a", {"q4_0": 0.05, "q4_1": 0.4, "q5_0": 0.01})
    alloc = allocate([b], nb("q4_1"), fixed_bytes=0)
    assert alloc.types["a"] == "q4_0"
    assert allocate([b], nb("q5_0"), fixed_bytes=0).types["a"] == "q5_0"


def test_an_unmeasured_candidate_is_estimated_from_the_nearest_measured_one():
    b = Bank("a", "experts", SHAPE, {"q4_k": 4.0, "q6_k": 1.0, "q8_0": 0.5}, {"q4_k": 0.2, "q6_k": 0.05}, "q4_k")
    assert b.estimate("q8_0") == pytest.approx(0.025) and b.estimate("q4_k") == 0.2


def test_a_budget_below_the_cheapest_plan_is_refused():
    with pytest.raises(BudgetTooSmall, match="cheapest plan needs"):
        allocate([_bank("a", {"q2_k": 1.0})], nb("q2_k") - 1, fixed_bytes=0)
    with pytest.raises(BudgetTooSmall):
        allocate([_bank("a", {"q2_k": 1.0})], nb("q2_k"), fixed_bytes=1)
