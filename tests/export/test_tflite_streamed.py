"""The TFLite export streams: each chunk of decoder layers is read from the checkpoint and converted in a process of
its own (litert-torch's interpreter), so this process never holds the model; the chunks run in sequence in the LiteRT
interpreter and are checked against transformers, streamed from disk when the model does not fit; a model whose
chunk does not fit is refused before anything is written."""

from __future__ import annotations

import pytest
from streamed_fixtures import deep_moe as deep_moe_at
from streamed_fixtures import live_tensor_bytes

from moetool.api import export, plan_export
from moetool.compute.upcast import float32_overhead
from moetool.export.graph.chunk_memory import ChunkPlan, chunked_memory
from moetool.export.reference import VERIFY_OVERHEAD
from moetool.export.tflite import exporter
from moetool.io.budget import BudgetError
from moetool.io.checkpoint import Checkpoint

QUANT = "experts=q4_0,router=f32,*=q8_0"


@pytest.fixture(scope="module")
def deep_moe(tmp_path_factory):
    return deep_moe_at(tmp_path_factory.mktemp("tflite-deep"))


def test_converted_a_chunk_at_a_time_elsewhere_and_checked_in_the_interpreter(deep_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    config = Checkpoint(deep_moe).config
    plan = plan_export(deep_moe, tmp_path / "plan", target="tflite", quant=QUANT)[2]
    params = plan.quant.total_params
    ranges = [(0, 2), (2, 4), (4, 6), (6, 8)]
    held = params * 2 + float32_overhead(params, config) + VERIFY_OVERHEAD  # the bf16 reference held whole
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(held - 1))  # the held reference does not fit; the chunks do
    mem = chunked_memory(plan, ranges, multiples=exporter.CONVERT_MULTIPLES, runtime=exporter.RUNTIME, piece="model")
    assert exporter.tflite_need(ChunkPlan(ranges, mem), verify=True, output=tmp_path / "x", disk=0).memory < held - 1
    before = live_tensor_bytes()  # what earlier tests (module fixtures, caches) left alive in this process
    seen, run_worker = [], exporter.run_worker

    def recorded(module, request, **kw):
        seen.append((module, live_tensor_bytes() - before))
        return run_worker(module, request, **kw)

    monkeypatch.setattr(exporter, "run_worker", recorded)
    man = export(deep_moe, tmp_path / "tfl", target="tflite", quant=QUANT, chunk_layers=2, jobs=1)
    # four conversions, one at a time, then the check; this process holds none of the model meanwhile (up to 256 KiB
    # of what else the run creates: loader and tokenizer caches)
    assert [m for m, _ in seen] == ["moetool.export.tflite.worker"] * 4 + ["moetool.export.tflite.chain_worker"]
    assert max(b for _, b in seen) <= 256 << 10, seen
    assert [c["layers"] for c in man["chunks"]] == [[0, 2], [2, 4], [4, 6], [6, 8]] and man["jobs"] == 1
    assert set(man["files"]) == {f"model_chunk0{i}.tflite" for i in range(4)}
    assert man["quantized_roles"] == {"experts": "int4", "attention": "int8", "output": "int8"}
    assert man["moe_kernel"]["layers"] == 8 and man["cache_tensors"] == 16
    p = man["parity"]
    assert p["reference"] == "transformers float32, layer by layer streamed from disk over bfloat16 weights"
    # (a random narrow model at 4 bits: its figures are low; the fp32 chain is held to the gate in test_graph_targets)
    assert p["decode"]["steps"] == 8 and 0 < p["top1_agreement"] <= 1
    # two chunks converted at once, checked against the float32 model held whole: the same figures
    monkeypatch.delenv("MOETOOL_MEMORY_BUDGET")
    two = export(deep_moe, tmp_path / "held", target="tflite", quant=QUANT, chunk_layers=4, jobs=2)
    assert set(two["files"]) == {"model_chunk00.tflite", "model_chunk01.tflite"} and two["jobs"] == 2
    whole = two["parity"]
    assert whole["reference"] == "transformers float32"
    assert p["ppl_artifact"] == pytest.approx(whole["ppl_artifact"], rel=1e-5)
    assert p["max_abs_logit_diff"] == pytest.approx(whole["max_abs_logit_diff"], abs=1e-4)


def test_refused_up_front_when_one_chunk_does_not_fit(deep_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(64 << 20))
    with pytest.raises(BudgetError, match="--chunk-layers"):
        export(deep_moe, tmp_path / "o", target="tflite", quant=QUANT)
    assert not (tmp_path / "o").exists()


def test_the_checks_files_lie_in_the_outputs_temporary_folder(tmp_path, monkeypatch):
    """The calls and logits handed to the interpreter's process sit beside the models, in the output's temporary
    folder (swept by the next run if this one is killed), and are gone once the check returns."""
    from pathlib import Path

    import numpy as np

    seen: dict = {}

    def interpreter(module: str, request: dict, *, what: str) -> dict:
        seen.update(request)
        np.savez(request["out"], np.ones((1, 2, 5), dtype=np.float32))
        return {"calls": 1}

    monkeypatch.setattr(exporter, "run_worker", interpreter)
    folder = tmp_path / ".out.moetool-tmp-1-abcd"
    folder.mkdir()
    (model := folder / "model.tflite").write_bytes(b"")
    logits = exporter.interpreter_batch([model], 8, 4)([(np.array([[3, 4]]), None)])
    assert logits[0].shape == (1, 2, 5)
    assert Path(seen["calls"]).parent.parent == folder and Path(seen["out"]).parent.parent == folder
    assert list(folder.iterdir()) == [model]


def test_one_model_by_default_when_its_conversion_fits(deep_moe, tmp_path, monkeypatch):
    """LiteRT-LM runs one decoder model: without --chunk-layers the model is converted as one whenever that one
    conversion fits the available memory (bundled), and in chunks only when it does not."""
    from dataclasses import replace

    _, req, plan = plan_export(deep_moe, tmp_path / "o", target="tflite", quant=QUANT)
    whole = chunked_memory(plan, [(0, 8)], multiples=exporter.CONVERT_MULTIPLES, runtime=exporter.RUNTIME, piece="m")
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(whole.peak(True)))
    assert exporter.tflite_chunks(req, plan).ranges == [(0, 8)]
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(whole.peak(True) - 1))
    monkeypatch.setattr(exporter, "CHUNK_BYTES", 1)  # chunks of one layer where the model does not go as one
    assert len(exporter.tflite_chunks(req, plan).ranges) == 8
    monkeypatch.delenv("MOETOOL_MEMORY_BUDGET")  # what --chunk-layers asks for is kept
    assert exporter.tflite_chunks(replace(req, options={**req.options, "chunk_layers": 2}), plan).ranges == [
        (0, 2), (2, 4), (4, 6), (6, 8)
    ]  # fmt: skip
