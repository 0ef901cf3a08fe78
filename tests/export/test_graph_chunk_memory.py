"""What a chunked graph export is estimated to hold while a chunk converts: each tensor of the chunk (its layers, the
embedding in the first, the final norm and head in the last) times the target's multiple for it, by whether the plan
rounds it."""

from __future__ import annotations

import pytest
from streamed_fixtures import deep_moe as deep_moe_at

from moetool.api import plan_export
from moetool.export.graph.chunk_memory import Multiples, chunk_bytes, chunked_memory

QUANT = "experts=q4_0,router=f32,*=q8_0"
RANGES = [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk-memory")
    return plan_export(deep_moe_at(root), root / "plan", target="executorch", quant=QUANT)[2]


def _bytes(plan, pred) -> int:
    return sum(a.params * 4 for a in plan.quant.assignments if pred(str(a.entry.out_name)))


def _in_layers(a: int, b: int):
    return lambda n: n.startswith("layers.") and a <= int(n.split(".")[1]) < b


def test_each_chunk_holds_its_layers_and_the_first_and_last_their_ends(plan):
    got = chunk_bytes(plan, RANGES, Multiples(1.0))
    embed = _bytes(plan, lambda n: n == "embed.weight")
    head = _bytes(plan, lambda n: n in ("norm.weight", "lm_head.weight"))
    assert embed > 0 and head > embed  # the tied head is a tensor of the ExportLM's own
    assert got[1] == _bytes(plan, _in_layers(2, 4)) and got[2] == _bytes(plan, _in_layers(4, 6))
    assert got[0] == _bytes(plan, _in_layers(0, 2)) + embed
    assert got[3] == _bytes(plan, _in_layers(6, 8)) + head
    assert chunk_bytes(plan, [(0, 8)], Multiples(1.0)) == [sum(a.params * 4 for a in plan.quant.assignments)]


def test_rounded_tensors_count_at_their_own_multiple(plan):
    """ExecuTorch's torchao rounds the experts (int4) and attention (int8) before export, so they count at the
    quantized multiple; the routers and norms stay float; a named tensor (the embedding) at its own."""
    rounded = {n for n, p in plan.precisions().items() if p != "fp32"}
    middle_q = _bytes(plan, lambda n: _in_layers(2, 4)(n) and n in rounded)
    middle_f = _bytes(plan, lambda n: _in_layers(2, 4)(n) and n not in rounded)
    assert middle_q > 10 * middle_f > 0
    got = chunk_bytes(plan, RANGES, Multiples(7.0, 1.5, (("embed.weight", 3.0),)))
    assert got[1] == int(7.0 * middle_f + 1.5 * middle_q)
    embed = _bytes(plan, lambda n: n == "embed.weight")
    first_q = _bytes(plan, lambda n: _in_layers(0, 2)(n) and n in rounded)
    first_f = _bytes(plan, lambda n: _in_layers(0, 2)(n) and n not in rounded)
    assert got[0] == int(7.0 * first_f + 1.5 * first_q + 3.0 * embed)
    # a target that rounds after converting holds every tensor at its float multiple
    assert chunk_bytes(plan, RANGES, Multiples(5.0)) == [int(5.0 * b) for b in chunk_bytes(plan, RANGES, Multiples(1))]


def test_jobs_at_once_each_hold_a_chunk(plan):
    one = chunked_memory(plan, RANGES, multiples=Multiples(2.0), runtime=1000, piece="program")
    three = chunked_memory(plan, RANGES, multiples=Multiples(2.0), runtime=1000, piece="program", jobs=3)
    assert three.converting == 3 * one.converting and three.verifying == one.verifying
    assert three.chunks == "4 programs of up to 2 layers, 3 at once" and three.jobs == 3
