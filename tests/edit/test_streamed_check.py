"""An edit's parity check on a model that does not fit in memory reads both models one layer at a time from disk."""

from __future__ import annotations

import pytest

from conftest import save_dense
from edit.test_proofs import merge
from moetool import api
from moetool.edit.layout import read_layout
from moetool.edit.remove import remove_plan
from moetool.edit.run import edit_need


def test_remove_checks_streamed_when_the_model_does_not_fit_with_the_resident_figures(tmp_path, monkeypatch):
    # deep and narrow, as real models are: one layer is a small part of the whole
    root = tmp_path / "family"
    base = save_dense(root / "base", num_hidden_layers=6, tie_word_embeddings=True)
    family = {"base": base} | {f"e{i}": save_dense(root / f"e{i}", seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)}
    moe = merge(tmp_path, family, "deep", "")
    plan = remove_plan(read_layout(moe), ["x1"])
    resident = edit_need(plan, tmp_path / "x", verify=True, tuned=False).memory
    streamed = edit_need(plan, tmp_path / "x", verify=True, tuned=False, streamed=True).memory
    assert streamed < resident

    want = api.experts.remove(moe, ["x1"], tmp_path / "resident").parity
    assert "held" not in want
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str((streamed + resident) // 2))
    got = api.experts.remove(moe, ["x1"], tmp_path / "streamed").parity
    assert got["held"] == "streamed from disk, one layer at a time"
    assert got["vs_input_restricted"] == pytest.approx(want["vs_input_restricted"], abs=1e-6)
    assert got["vs_input_restricted"] <= got["tolerance"]
