"""`moetool eval` of a model that does not fit in memory streams its layers from disk, with the resident figures."""

from __future__ import annotations

import json

import pytest
from consumer_fixtures import merge
from typer.testing import CliRunner

from moetool.cli import app
from moetool.eval.residency import eval_need, eval_residency
from moetool.io.budget import BudgetError

TEXT = (
    "def main():\n    return sum(range(10))\n"
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software.\n"
    "The patient presented with acute bronchitis and was given rest and fluids.\n"
) * 12


@pytest.fixture()
def moe(tiny_models, tmp_path):
    return merge(tmp_path, tiny_models("llama"), "mixtral")


def _eval(moe, tmp_path, name, budget, monkeypatch):
    if budget is None:
        monkeypatch.delenv("MOETOOL_MEMORY_BUDGET", raising=False)
    else:
        monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(budget))
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    report = tmp_path / f"{name}.json"
    args = ["eval", str(moe), "--data", f"t={tmp_path / 't.txt'}", "--seq-len", "32", "-o", str(report)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(report.read_text()), " ".join(res.output.split())


def test_eval_streams_when_the_resident_model_does_not_fit(moe, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    resident = eval_need(moe, dtype="auto", seq_len=32).memory
    streamed = eval_need(moe, dtype="auto", seq_len=32, batch_size=1, streamed=True).memory
    assert streamed < resident
    budget = (resident + streamed) // 2  # fits one layer at a time, not the model

    want, said = _eval(moe, tmp_path, "resident", None, monkeypatch)
    assert "streamed" not in said and "streamed" not in want["models"][str(moe)]
    got, said = _eval(moe, tmp_path, "streamed", budget, monkeypatch)
    record = got["models"][str(moe)]
    assert "the resident model needs about" in record["streamed"] and "read from disk" in record["streamed"]
    assert f"{moe}: streamed from disk" in said
    assert record["arithmetic"] == "float32"
    # the same figures: float32 both ways, only the windows per forward pass differ
    assert got["perplexity"][str(moe)]["t"] == pytest.approx(want["perplexity"][str(moe)]["t"], rel=1e-5)
    share = got["routing"][str(moe)]["per_domain"]["t"]["expert_share"]
    for layer, ref in zip(share, want["routing"][str(moe)]["per_domain"]["t"]["expert_share"], strict=True):
        assert layer == pytest.approx(ref, abs=1e-6)


def test_a_model_that_fits_neither_way_is_refused_naming_both(moe, monkeypatch):
    streamed = eval_need(moe, dtype="auto", seq_len=32, batch_size=1, streamed=True).memory
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(streamed - 1))
    with pytest.raises(BudgetError, match=r"needs about .* Streamed from disk one layer at a time it would still need"):
        eval_residency(moe, dtype="auto", seq_len=32)


def test_a_short_last_window_rides_in_the_same_pass_with_the_resident_figures(moe):
    """Streamed, every batch reads the whole checkpoint: the shorter last window is padded into the last batch (its
    padding neither scored nor counted in the routing), so the text takes one pass, with the resident figures."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moetool.compute.stream import stream_of, streamed_causal_lm
    from moetool.eval.perplexity import text_windows, token_nll
    from moetool.routing.tap import RouterTap

    tok = AutoTokenizer.from_pretrained(str(moe))
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    windows = text_windows(ids, 32, tok.bos_token_id)
    assert len(windows) > 2 and len(windows[-1]) < len(windows[0])
    figures = {}
    for name, model in (
        ("resident", AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32)),
        ("streamed", streamed_causal_lm(moe, storage=torch.float32)),
    ):
        tap = RouterTap(model)
        with torch.inference_mode():
            nll, n = token_nll(model, tok, TEXT, seq_len=32, batch_size=len(windows), tap=tap)
        tap.remove()
        figures[name] = (nll, n, torch.cat(tap.logits[:: len(tap.routers)]))
    stream = stream_of(model)
    assert stream is not None and stream.passes == 1
    (nll_r, n_r, route_r), (nll_s, n_s, route_s) = figures["resident"], figures["streamed"]
    assert n_s == n_r == sum(len(w) - 1 for w in windows)
    assert nll_s == pytest.approx(nll_r, rel=1e-5)
    assert route_s.shape == route_r.shape == (sum(len(w) for w in windows), route_r.shape[-1])
    assert torch.allclose(route_s, route_r, atol=1e-4)
