"""GEM metrics reproduce the worked examples; eval reports match perplexities computed directly."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import TEXT, write_recipe
from moetool.api import assemble
from moetool.errors import MoetoolError
from moetool.eval.gem import (
    cross_domain_transfer_ratio,
    domain_specialization_index,
    gem_metrics,
    generalization_gap,
)
from moetool.eval.plots import write_plots
from moetool.eval.report import evaluate


@pytest.mark.parametrize(
    ("fn", "args", "expected"),
    [
        (generalization_gap, (0.95, 0.40), 0.578947368),
        (generalization_gap, (0.90, 0.62), 0.311111111),
        (cross_domain_transfer_ratio, (0.90, 0.60), 0.666666667),
        (cross_domain_transfer_ratio, (0.95, 0.40), 0.421052632),
        (domain_specialization_index, (0.90, [0.30]), 3.0),
        (domain_specialization_index, (0.95, [0.40, 0.45, 0.50]), 2.111111111),
    ],
)
def test_worked_examples(fn, args, expected):
    assert fn(*args) == pytest.approx(expected, abs=1e-9)


def test_cdtr_is_one_minus_gg_and_zero_is_an_error():
    assert cross_domain_transfer_ratio(0.95, 0.40) == pytest.approx(1 - generalization_gap(0.95, 0.40))
    with pytest.raises(MoetoolError):
        generalization_gap(0.0, 0.5)
    m = gem_metrics({"a": 0.9, "b": 0.3}, "a")
    assert m["gg"] == pytest.approx(generalization_gap(0.9, 0.3)) and m["dsi"] == pytest.approx(3.0)
    assert m["cdtr"]["a"]["b"] == pytest.approx(1 / 3)


def test_eval_report_matches_direct_perplexity(tiny_models, tmp_path):
    m = tiny_models("llama")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
name: ev
method: mofe
base_model: {m["base"]}
gate_mode: hidden
experts:
  - {{name: code, source: {m["e1"]}, positive_prompts: ["def main():"]}}
  - {{name: legal, source: {m["e2"]}, positive_prompts: ["Permission is hereby granted"]}}
""",
    )
    moe = assemble(recipe, tmp_path / "moe")
    texts = {"code": TEXT.split("\n")[0] * 3, "legal": TEXT.split("\n")[1] * 3}
    report = evaluate({"moe": moe, "base": m["base"]}, texts, own_domains={"base": None}, seq_len=16)
    report = json.loads(json.dumps(report))  # JSON-ready
    for name, path in (("moe", moe), ("base", m["base"])):
        model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
        tok = AutoTokenizer.from_pretrained(str(path))
        for d, text in texts.items():
            ids = tok(text, add_special_tokens=False)["input_ids"]
            nll, n = 0.0, 0
            for i in range(0, len(ids), 15):  # windows of BOS + 15 tokens, BOS not scored
                w = torch.tensor([[tok.bos_token_id, *ids[i : i + 15]]])
                with torch.no_grad():
                    loss = model(w, labels=w).loss.item()
                nll += loss * (w.shape[1] - 1)
                n += w.shape[1] - 1
            assert report["perplexity"][name][d] == pytest.approx(math.exp(nll / n), rel=1e-5)
    routing = report["routing"]["moe"]
    assert routing["experts"] == ["code", "legal"] and "base" not in report["routing"]
    for d in texts:
        shares = routing["per_domain"][d]["expert_share"]
        assert len(shares) == 2 and all(sum(layer) == pytest.approx(1.0) for layer in shares)
        assert all(0 <= h <= math.log(2) + 1e-6 for h in routing["per_domain"][d]["entropy"])
    perf = {d: 1 / report["perplexity"]["base"][d] for d in texts}
    assert report["gem"]["base"]["dsi_per_domain"]["code"] == pytest.approx(perf["code"] / perf["legal"])
    paths = write_plots(report, tmp_path / "plots")
    assert len(paths) == 2
    import matplotlib.image

    for p in paths:
        assert matplotlib.image.imread(str(p)).shape[0] > 100
