"""An edited MoE is a standard folder for every consumer: its GGUF passes moetool's own llama.cpp parity gate, and
llama.cpp's converter turns it into a file that computes transformers' logits; the CLI prints what it did."""

from __future__ import annotations

import json
from pathlib import Path

import llama_cpp  # noqa: F401  (the dev extra installs it; a missing runtime must fail, not skip)
import pytest
from typer.testing import CliRunner

from conftest import TEXT
from edit.test_proofs import SHARED, merge
from export.test_converter_roundtrip import converter, lc  # noqa: F401  (the session fixture)
from moetool import api
from moetool.cli import app
from moetool.export.gguf.exporter import GATES
from moetool.export.gguf.tokenizer import read_vocab
from moetool.export.gguf.verify import compare

# name: (dense family, recipe lines): one of each llama.cpp architecture an edited folder becomes
CASES = {
    "mixtral": ("llama", ""),
    "qwen2_moe-shared": ("qwen2", SHARED),
    "qwen3_moe": ("qwen3", ""),
    "granitemoe": ("granite", ""),
}


@pytest.fixture(scope="module", params=list(CASES))
def edited(request, tiny_models, tmp_path_factory) -> dict[str, Path]:
    """A 3-expert MoE pruned by frequency to 2, with an expert added back: every kind of edit in one folder."""
    family, extra = CASES[request.param]
    m = tiny_models(family)
    tmp = tmp_path_factory.mktemp("edited")
    moe = merge(tmp, m, "moe", extra.format(base=m["base"]))
    text = tmp / "calib.txt"
    text.write_text(TEXT * 4)
    pruned = api.experts.prune(moe, tmp / "pruned", keep=2, by="frequency", data={"mix": str(text)}).output
    gone = next(n for n in ("x1", "x2", "x3") if n not in json.loads((pruned / "moetool.json").read_text())["experts"])
    added = api.experts.add(pruned, m[f"e{gone[1]}"], tmp / "added", name=gone, prompts=["acute bronchitis"]).output
    return {"moe": moe, "pruned": pruned, "added": added}


@pytest.mark.parametrize("which", ["pruned", "added"])
def test_edited_gguf_passes_the_parity_gate(edited, tmp_path, which):
    man = api.export(edited[which], tmp_path / "gguf", quant="f32")  # the exporter's gate raises on a failure
    assert max(man["parity"]["max_abs_logit_diff"].values()) <= GATES["f32"]


def test_edited_folder_through_llama_cpps_converter(edited, converter, tmp_path):  # noqa: F811
    moe = edited["added"]
    theirs = lc.convert(moe, tmp_path / "converted.gguf", outtype="f32", pre=read_vocab(moe).pre, converter=converter)
    report = compare(theirs, moe, TEXT)
    assert report.tokenizer_match, report.tokenizer_mismatches
    assert max(report.max_abs_logit_diff.values()) <= GATES["f32"], report.max_abs_logit_diff


def test_cli_remove_extract_list_and_a_named_error(edited, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["experts", "remove", str(edited["moe"]), "x1", "-o", str(tmp_path / "rm")])
    assert r.exit_code == 0, r.output
    assert "removed x1 (3 → 2 experts, top-2)" in r.output and "parity vs_input_restricted" in r.output
    r = runner.invoke(app, ["experts", "extract", str(edited["moe"]), "x2", "-o", str(tmp_path / "x2")])
    assert r.exit_code == 0 and (tmp_path / "x2" / "config.json").is_file(), r.output
    r = runner.invoke(app, ["experts", "list", str(tmp_path / "rm"), "-o", str(tmp_path / "l.json")])
    assert r.exit_code == 0 and json.loads((tmp_path / "l.json").read_text())["experts"] == ["x2", "x3"], r.output
    r = runner.invoke(app, ["experts", "remove", str(edited["moe"]), "x1", "-o", str(tmp_path / "dry"), "--dry-run"])
    assert r.exit_code == 0 and "(dry run: nothing written)" in r.output and "experts: x2, x3" in r.output, r.output
    assert not (tmp_path / "dry").exists()
    r = runner.invoke(app, ["experts", "remove", str(edited["moe"]), "nope", "-o", str(tmp_path / "bad")])
    assert r.exit_code == 2 and "no expert 'nope'" in r.output and not (tmp_path / "bad").exists()
