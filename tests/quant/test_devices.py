"""Device profiles pick the format and the best plan that fits, or refuse with the numbers."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from moetool.api import plan_export
from moetool.cli import app
from moetool.export import ExportError
from moetool.quant import devices
from moetool.quant.devices import DEVICES, estimate_memory


def test_required_profiles():
    for name, gb in (("raspberry-pi-4", 4), ("pixel-6", 8), ("iphone-13", 6)):
        d = DEVICES[name]
        assert d.memory == gb * 1000**3 and 0 < d.budget < d.memory and "gguf" in d.formats
    assert DEVICES["pixel-6"].formats[0] == "tflite" and DEVICES["iphone-13"].formats[0] == "coreml"
    assert "laptop" in DEVICES


def test_memory_estimate_parts():
    cfg = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 32,
        "vocab_size": 100,
    }
    m = estimate_memory(1000, cfg, context=64)
    assert m.kv_cache == 2 * 2 * 2 * 8 * 64 * 2  # K and V, layers, kv heads, head dim, tokens, f16
    assert m.total == m.weights + m.kv_cache + m.runtime


def test_device_picks_best_fitting_plan_or_refuses(tiny_models, tmp_path, monkeypatch):
    base = tiny_models("llama")["base"]
    sizes = {
        q: plan_export(base, tmp_path / "x", quant=q, context=256)[2].memory.total for q in ("f16", "q8_0", "q4_0")
    }
    assert sizes["f16"] > sizes["q8_0"] > sizes["q4_0"]
    dev = dataclasses.replace(
        DEVICES["raspberry-pi-4"],
        name="tiny-board",
        budget=sizes["q8_0"] - 1,
        ladder=("f16", "q8_0", "q4_0"),
        context=256,
    )
    monkeypatch.setitem(devices.DEVICES, "tiny-board", dev)
    _, _, plan = plan_export(base, tmp_path / "x", for_="tiny-board")
    assert plan.quant.label == "q4_0" and [c[2] for c in plan.candidates] == [False, False, True]
    monkeypatch.setitem(devices.DEVICES, "tiny-board", dataclasses.replace(dev, budget=sizes["q4_0"] - 1))
    with pytest.raises(ExportError, match=r"no plan fits tiny-board .*f16: .* GB; q8_0: .*q4_0"):
        plan_export(base, tmp_path / "x", for_="tiny-board")
    # a device's preferred format is chosen: pixel-6 → tflite, iphone-13 → coreml, raspberry-pi-4 → gguf
    for dev, fmt in (("pixel-6", "tflite"), ("iphone-13", "coreml"), ("raspberry-pi-4", "gguf"), ("laptop", "gguf")):
        assert plan_export(base, tmp_path / "x", for_=dev)[0].name == fmt
    with pytest.raises(ExportError, match="runs gguf, not onnx"):
        plan_export(base, tmp_path / "x", for_="raspberry-pi-4", target="onnx")


def test_cli_dry_run_prints_plan_and_writes_nothing(tiny_models, tmp_path):
    base = tiny_models("llama")["base"]
    r = CliRunner().invoke(
        app,
        [
            "export",
            str(base),
            "-o",
            str(tmp_path / "o"),
            "--quant",
            "moe-q4",
            "--for",
            "raspberry-pi-4",
            "--dry-run",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "total" in r.output and "budget on raspberry-pi-4" in r.output and "attention" in r.output
    assert not (tmp_path / "o").exists()
    r = CliRunner().invoke(app, ["export", str(base), "-o", str(tmp_path / "o"), "--for", "toaster"])
    assert r.exit_code == 2 and "unknown device 'toaster'" in r.output
    r = CliRunner().invoke(app, ["export", str(base), "-o", str(tmp_path / "o"), "--target", "tensorrt"])
    assert r.exit_code == 2 and "unknown target 'tensorrt'; available: gguf, onnx" in r.output
    r = CliRunner().invoke(app, ["devices"])
    assert r.exit_code == 0 and "iphone-13" in r.output
