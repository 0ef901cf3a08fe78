"""Commands whose optional dependency is missing: one line naming the set-up command the README gives, exit code 2,
nothing written (issue 20). A package is made missing by putting None in ``sys.modules``, which makes its import fail
the way an absent package does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ONNX = "bash scripts/setup.sh --onnx (or pip install 'moetool[onnx]')"


@pytest.fixture
def no_onnxscript(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "onnxscript", None)


@pytest.mark.parametrize("command", [["export"], ["hybrid", "export"]], ids=["export", "hybrid-export"])
def test_hybrid_export_without_the_onnx_extra(env, refused, no_onnxscript, command):
    # refused before the model is read: only the hybrid model's marker is there
    model = env.root / "hybrid"
    model.mkdir()
    (model / "hybrid.json").write_text("{}")
    refused(
        [*command, str(model), "-o", str(env.outs / "hx")],
        ["the hybrid router's ONNX export (router.onnx) needs onnxscript (the onnx extra)", ONNX],
        inputs=[model],
        sandbox=env.root,
    )


@pytest.mark.parametrize("command", [["export"], ["gem", "export"]], ids=["export", "gem-export"])
def test_gem_sequence_export_without_the_onnx_extra_refuses_once(env, refused, no_onnxscript, command):
    """Only the router needs onnx, but a bundle without its router cannot dispatch: one refusal, before any
    pathway is exported, saying the router is why."""
    bundle = env.root / "bundle"
    bundle.mkdir()
    (bundle / "gem.json").write_text("{}")  # the marker of a sequence-level bundle; nothing else is read first
    refused(
        [*command, str(bundle), "-o", str(env.outs / "gx"), "--target", "gguf"],
        ["the sequence-level GEM router (router.onnx, written beside the gguf pathways) needs onnxscript", ONNX],
        inputs=[bundle],
        sandbox=env.root,
    )


def test_onnx_export_without_onnxscript(env, refused, no_onnxscript):
    refused(
        ["export", str(env.models["base"]), "-o", str(env.outs / "ox"), "--target", "onnx", "--quant", "f32"],
        ["--target onnx needs onnxscript (the onnx extra)", ONNX],
        inputs=[env.models["base"]],
        sandbox=env.root,
    )


def test_flower_without_flwr_names_the_readme_command(env, refused, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "flwr", None)
    recipe = env.work / "comigs.yaml"
    shutil.copy(ROOT / "recipes" / "demo-comigs.yaml", recipe)
    res = refused(
        ["comigs", "train", str(recipe), "-o", str(env.outs / "cx"), "--engine", "flower"],
        ["--engine flower needs flwr (the comigs extra)", "bash scripts/setup.sh --comigs", ".venv-flwr/bin/moetool"],
        inputs=[recipe],
        sandbox=env.root,
    )
    # the README's set-up line for Flower is the one the error gives
    assert "bash scripts/setup.sh --comigs" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "setup_comigs.sh" not in res.output
