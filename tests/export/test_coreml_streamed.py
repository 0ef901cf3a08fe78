"""The Core ML export streams: each chunk of decoder layers is read from the checkpoint, converted and dropped before
the next, so a model whose 16-bit copy does not fit is exported in chunks and checked, chunk by chunk, against a
reference streamed from disk; a model whose chunk does not fit is refused before anything is written."""

from __future__ import annotations

import pytest
from streamed_fixtures import deep_moe as deep_moe_at
from streamed_fixtures import live_tensor_bytes

from moetool.api import export, plan_export
from moetool.compute.upcast import float32_overhead, layer_bytes
from moetool.export.coreml import exporter
from moetool.export.coreml.chunks import CHUNK_BYTES
from moetool.export.graph.chunk import chunk_ranges
from moetool.export.graph.chunk_memory import ChunkPlan, chunked_memory
from moetool.export.reference import VERIFY_OVERHEAD, streamed_need
from moetool.io.budget import BudgetError
from moetool.io.checkpoint import Checkpoint

QUANT = "experts=q4_0,router=f32,*=q8_0"


@pytest.fixture(scope="module")
def deep_moe(tmp_path_factory):
    return deep_moe_at(tmp_path_factory.mktemp("coreml-deep"))


def test_converted_a_chunk_at_a_time_and_checked_against_a_streamed_reference(deep_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    config = Checkpoint(deep_moe).config
    plan = plan_export(deep_moe, tmp_path / "plan", target="coreml", quant=QUANT)[2]
    params = plan.quant.total_params
    outside, layer = layer_bytes(config, params)
    # a streamed reference beside two-layer chunks fits; the bf16 model held for the reference does not
    low = streamed_need(params, config) + outside + 2 * layer
    held = params * 2 + float32_overhead(params, config) + VERIFY_OVERHEAD
    assert low < held
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str((low + held) // 2))
    ranges = chunk_ranges(8, layer, CHUNK_BYTES, 2)
    mem = chunked_memory(plan, ranges, multiples=exporter.CONVERT_MULTIPLES, runtime=exporter.RUNTIME, piece="chunk")
    assert exporter.coreml_need(ChunkPlan(ranges, mem), verify=True, output=tmp_path / "x", disk=0).memory == low
    before = live_tensor_bytes()  # what earlier tests (module fixtures, caches) left alive in this process
    peak = [0]
    convert = exporter.convert

    def measured(chunk, fp16, units):
        peak[0] = max(peak[0], live_tensor_bytes() - before)
        return convert(chunk, fp16, units)

    monkeypatch.setattr(exporter, "IN_CHILD", False)  # in this process, where its tensors can be counted
    monkeypatch.setattr(exporter, "convert", measured)
    man = export(deep_moe, tmp_path / "cm", target="coreml", quant=QUANT, chunk_layers=2)
    # never the model whole: the weights outside the layers and one chunk of two layers (and up to 256 KiB of what
    # else the run creates: rope tables, the caches' buffers, tokenizer and loader caches)
    assert peak[0] <= outside + 2 * layer + (256 << 10), (peak[0], outside, layer)
    assert peak[0] < params * 4 / 2
    assert [c["layers"] for c in man["chunks"]] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    p = man["parity"]
    assert p["reference"] == "transformers float32, layer by layer streamed from disk over bfloat16 weights"
    assert p["verdict"] == "pass" and max(p["max_abs_logit_diff"].values()) <= 1e-4
    assert p["decode"]["max_abs_logit_diff"] <= 1e-4
    # the same chunks checked against the float32 model held whole: the same figures, and the whole ExportLM's
    monkeypatch.delenv("MOETOOL_MEMORY_BUDGET")
    whole = export(deep_moe, tmp_path / "held", target="coreml", quant=QUANT, chunk_layers=2)["parity"]
    assert whole["reference"] == "transformers float32"
    assert max(whole["export_model_vs_transformers"].values()) < 1e-4
    assert p["ppl_artifact"] == pytest.approx(whole["ppl_artifact"], rel=1e-5)


def test_refused_up_front_when_one_chunk_does_not_fit(deep_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(64 << 20))
    with pytest.raises(BudgetError, match="--chunk-layers"):
        export(deep_moe, tmp_path / "o", target="coreml", quant=QUANT)
    assert not (tmp_path / "o").exists()


class _TorchPackage:
    """Stands in for ``coremltools.models.MLModel`` on Linux (no ``predict`` here): the joined package's chunks, read
    again from the checkpoint into the wrappers that were converted and run in turn, fed by the names the package
    declares (its recorded structure)."""

    def __init__(self, src, manifest):
        from moetool.export.coreml.stateful import StatefulChunk

        chunks = manifest["chunks"]
        self.wrappers = []
        for index, chunk in enumerate(chunks):
            start, stop = chunk["layers"]
            blocks = {i: src.block(i) for i in range(start, stop)}
            last = index == len(chunks) - 1
            self.wrappers.append(
                StatefulChunk(src.em, blocks, manifest["capacity"], first=index == 0, last=last).eval()
            )
        self.inputs, self.outputs = manifest["structure"]["inputs"], manifest["structure"]["outputs"]

    def make_state(self):
        for w in self.wrappers:  # one state for the whole package: a new sequence empties every chunk's slots
            w.reset()
        return self.wrappers

    def predict(self, feed, state):
        import numpy as np
        import torch

        assert list(feed) == self.inputs, (list(feed), self.inputs)  # the names the package takes, in its order
        x, mask = (torch.from_numpy(np.asarray(feed[n])) for n in self.inputs)
        x = x.long()
        with torch.no_grad():
            for w in state:
                x = w(x, mask.float())
        return {self.outputs[0]: x.numpy()}


def test_the_mac_script_runs_the_one_package(deep_moe, tmp_path, monkeypatch, capsys):
    """scripts/coreml_parity_mac.py feeds the one package a chunked export joined, as an app does: the names its
    manifest records, one state per sequence, prefill then decode (Core ML itself replaced by the converted wrappers,
    run in turn as the joined program runs them)."""
    import importlib.util
    import json
    import sys
    import types
    from pathlib import Path

    from moetool.export.graph.stream import streamed_export_model

    out = tmp_path / "cm"
    man = export(deep_moe, out, target="coreml", quant="f32", chunk_layers=3, verify=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [c["layers"] for c in manifest["chunks"]] == [[0, 3], [3, 5], [5, 8]] and man["parity"].startswith(
        "not verified"
    )
    assert manifest["file"] == "model.mlpackage" and manifest["join"]["chunks"] == 3
    assert not any(p.name.startswith("model_chunk") for p in out.iterdir())  # joined, then removed
    src = streamed_export_model(deep_moe)

    def package(path):
        assert Path(path) == out / "model.mlpackage"
        return _TorchPackage(src, manifest)

    fake = types.ModuleType("coremltools")
    fake.models = types.SimpleNamespace(MLModel=package)
    monkeypatch.setitem(sys.modules, "coremltools", fake)
    spec = importlib.util.spec_from_file_location("coreml_parity_mac", Path("scripts/coreml_parity_mac.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["coreml_parity_mac.py", str(out), str(deep_moe), "--tol", "1e-4"])
    assert script.main() == 0, capsys.readouterr().out
    assert "decode 8 steps with states" in capsys.readouterr().out
