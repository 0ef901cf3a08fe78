"""The margin gate (moetool.export.gate) on real exports: sound files pass where raw top-1 agreement falls below
0.95 (near-ties), and files broken after writing fail at every plan: a changed rope base, two experts swapped, two
layers swapped, a router row zeroed.

A breaker edits the written GGUF in place (gguf-py's reader in ``r+`` mode) between the write and the verification,
so the export under test verifies exactly the broken file; the dequantized-weights run then carries the breakage too
(it reads the same file), so the gate must catch it against the source model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import llama_cpp  # noqa: F401  (the dev extra installs it; a missing runtime must fail, not skip)
import numpy as np
import pytest

from conftest import save_dense, write_recipe
from moetool.api import assemble, export
from moetool.export import ExportError
from moetool.export.base import Manifest
from moetool.export.gate import GateReport, family_of, kl_divergence, margin_gate, top_margin
from moetool.export.parity import ParityRecord

PLANS = ["f16", "q8_0", "experts=q4_0,router=f32,*=q8_0"]
EXPERTS3 = """
experts:
  - {{name: code, source: {e1}, positive_prompts: ["def main():"]}}
  - {{name: legal, source: {e2}, positive_prompts: ["Permission is hereby granted"]}}
  - {{name: medical, source: {e3}, positive_prompts: ["acute bronchitis"]}}
"""


@pytest.fixture(scope="module")
def moe(tiny_models, tmp_path_factory):
    """test_gguf's three-expert Mixtral: each router row from its own prompts, so swapping experts matters."""
    m = tiny_models("llama")
    tmp = tmp_path_factory.mktemp("gate")
    text = f"name: g3\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\n" + EXPERTS3.format(
        e1=m["e1"], e2=m["e2"], e3=m["e3"]
    )
    return assemble(write_recipe(tmp / "g3.yaml", text), tmp / "g3")


def _tensors(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    return {t.name: t.data for t in reader.tensors}


def rope_base(path: Path) -> None:
    """llama.cpp rotates with base 1000 instead of the model's 10000."""
    field = gguf.GGUFReader(str(path), "r+").fields["llama.rope.freq_base"]
    field.parts[field.data[0]][0] = 1000.0


def swap_experts(path: Path) -> None:
    """Experts 0 and 1 of layer 0 trade weights; the router still sends expert 0's tokens to slot 0."""
    t = _tensors(gguf.GGUFReader(str(path), "r+"))
    for kind in ("gate", "up", "down"):
        w = t[f"blk.0.ffn_{kind}_exps.weight"]
        w[[0, 1]] = w[[1, 0]]


def swap_layers(path: Path) -> None:
    """Every tensor of layer 0 trades places with layer 1's."""
    t = _tensors(gguf.GGUFReader(str(path), "r+"))
    for name in [n for n in t if n.startswith("blk.0.")]:
        a, b = t[name], t[name.replace("blk.0.", "blk.1.", 1)]
        keep = np.array(a)
        a[...] = b
        b[...] = keep


def zero_router_row(path: Path) -> None:
    """Layer 0's router never scores expert 0 (a zero logit instead of its prompts' direction)."""
    t = _tensors(gguf.GGUFReader(str(path), "r+"))
    t["blk.0.ffn_gate_inp.weight"][0] = 0.0


BREAKS: dict[str, Callable[[Path], None]] = {
    "rope-base": rope_base,
    "experts-swapped": swap_experts,
    "layers-swapped": swap_layers,
    "router-row-zeroed": zero_router_row,
}


def _break_after_writing(monkeypatch: pytest.MonkeyPatch, breaker: Callable[[Path], None]) -> None:
    from moetool.export.gguf import exporter

    real = exporter.check_types

    def check_then_break(path: Path, plan: object) -> None:
        real(path, plan)  # type: ignore[arg-type]
        breaker(path)

    monkeypatch.setattr(exporter, "check_types", check_then_break)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("broken", list(BREAKS))
def test_broken_artifacts_fail_at_every_plan(moe, tmp_path, monkeypatch, broken, plan):
    """Each breakage is refused by the gate (nothing written), whatever the plan."""
    _break_after_writing(monkeypatch, BREAKS[broken])
    with pytest.raises(ExportError, match="parity failed"):
        export(moe, tmp_path / "o", quant=plan)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("plan", PLANS)
def test_sound_artifacts_pass_with_the_figures_recorded(moe, tmp_path, plan):
    """The manifest records the gate beside the raw top-1 figures, and the typed manifest reads it back."""
    man = Manifest.of(export(moe, tmp_path / "o", quant=plan), source="test")
    gate, parity = man.gate, man.parity
    assert isinstance(parity, ParityRecord) and gate is not None and gate.passed and parity.gate == gate
    assert man["parity"]["gate"]["verdict"] == "pass" and parity.outcome == "pass"
    assert parity.tolerance == (1e-2 if plan == "f16" else None)  # a float plan's conversion has a tolerance too
    assert gate.tokens == 512 and gate.kl_mean <= gate.kl_bound / 3  # room under the bound
    assert gate.raw_top1 == pytest.approx(parity.top1_agreement, abs=1e-6)
    assert parity.conversion is not None
    assert gate.raw_top1_conversion == pytest.approx(parity.conversion.top1_agreement, abs=1e-6)
    assert gate.agreement in (None, 1.0) and gate.family == {"f16": "float", "q8_0": "q8_0"}.get(plan, "q4")


def test_near_ties_fail_raw_top1_but_pass_the_gate(tmp_path):
    """A random model with many near-ties: 8,192 output rows (the top two of many logits lie close) and four layers
    of large random weights (the rounding noise grows with depth). Its sound q8_0 file fails the old gate (raw top-1
    agreement < 0.95, on the dequantized run and on the source), yet every decisive token agrees and the mean KL is
    within its bound. (Scaling the head down to flatten the logits would not do: the noise scales with them.)"""
    d = save_dense(
        tmp_path / "wide", "llama", vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4
    )
    man = Manifest.of(export(d, tmp_path / "o", quant="q8_0"), source="test")
    gate = man.gate
    assert gate is not None and gate.passed
    assert gate.raw_top1_conversion < 0.95 and gate.raw_top1 < 0.95
    assert gate.agreement_judged and gate.agreement == 1.0 and gate.kl_mean <= gate.kl_bound / 2


def test_the_rule_on_synthetic_logits():
    """Decisive tokens: margin > 2 × (2 × max|D - R| + floor); agreement counts only those; KL in float64; a tensor
    past its type's rounding fails the gate whatever the logits."""
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(64, 50)).astype(np.float32)
    own = ref + rng.uniform(-0.01, 0.01, size=ref.shape).astype(np.float32)
    got = own.copy()
    m = top_margin(ref.astype(np.float64))
    flip = np.flatnonzero(m < 0.01)  # near-ties llama.cpp reverses: not decisive, so not counted
    for t in flip:
        i, j = np.argsort(ref[t])[-2:]
        got[t, [i, j]] = got[t, [j, i]]
    gate = margin_gate([ref], [own], [got], {"q8_0"})
    noise = 2 * np.abs(own.astype(np.float64) - ref).max(-1)
    assert gate.decisive == int((m > 2 * noise).sum()) and gate.agreement == 1.0
    assert gate.raw_top1 == pytest.approx(1 - len(flip) / 64)
    assert kl_divergence(ref, ref).max() == 0.0 and gate.kl_mean > 0
    report = GateReport.from_json(gate.to_json())
    assert report.decisive == gate.decisive and report.passed and report.family == "q8_0"
    swapped = margin_gate(
        [ref], [own], [got], {"q8_0"}, {"a": ("q8_0", 0.005, 0.0), "b.experts.1": ("q8_0", 1.41, 1.4)}
    )
    assert not swapped.passed and "b.experts.1 (q8_0) differs from its source by 141%" in swapped.problems[0]
    assert swapped.rounding == {"q8_0": 1.41}
    near = margin_gate([ref], [own], [got], {"q8_0"}, {"a": ("q8_0", 0.005, 0.0), "b": ("q8_0", 0.008, 0.005)})
    assert not near.passed and "b (q8_0) lies 0.50% from the source rounded to q8_0" in near.problems[0]
    wrong = rng.normal(size=ref.shape).astype(np.float32)  # an unrelated model: both checks fail
    bad = margin_gate([ref], [ref], [wrong], {"q8_0"})
    assert not bad.passed and len(bad.problems) == 2


def test_families_pick_the_lowest_precision():
    assert family_of({"f32", "f16"}) == "float" and family_of({"q8_0", "f16"}) == "q8_0"
    assert family_of({"q8_0", "q4_k"}) == "q4" and family_of({"q6_k", "iq2_xs"}) == "lower"
    assert family_of({"q5_k", "q6_k"}) == "q5"
