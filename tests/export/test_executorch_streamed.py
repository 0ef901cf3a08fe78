"""The ExecuTorch export streams: each chunk of decoder layers is read from the checkpoint, quantized, lowered and
written as its own program before the next is read (in a process of its own by default; here in the test's) (``test_graph_targets.py``: what a chunk holds while it is
lowered); a model whose chunk does not fit is refused before anything is written."""

from __future__ import annotations

import pytest
from streamed_fixtures import deep_moe as deep_moe_at
from streamed_fixtures import live_tensor_bytes

from moetool.api import export, plan_export
from moetool.compute.upcast import layer_bytes
from moetool.export.executorch import exporter, lowering
from moetool.io.budget import BudgetError
from moetool.io.checkpoint import Checkpoint

QUANT = "experts=q4_0,router=f32,*=q8_0"


@pytest.fixture(scope="module")
def deep_moe(tmp_path_factory):
    return deep_moe_at(tmp_path_factory.mktemp("executorch-deep"))


def test_a_chunk_is_quantized_and_lowered_alone(deep_moe, tmp_path, monkeypatch):
    """What is alive when each chunk is lowered (XNNPACK's lowering itself replaced by a recorder: it is slow, and
    ``test_graph_targets.py`` runs it): the weights outside the layers and that chunk's two layers, quantized."""
    plan = plan_export(deep_moe, tmp_path / "plan", target="executorch", quant=QUANT)[2]
    outside, layer = layer_bytes(Checkpoint(deep_moe).config, plan.quant.total_params)
    before = live_tensor_bytes()  # what earlier tests (module fixtures, caches) left alive in this process
    peak, lowered = [0], []

    def recorded(chunk, bounds, step=None):
        peak[0] = max(peak[0], live_tensor_bytes() - before)
        lowered.append(sorted({int(n.split(".")[1]) for n, _ in chunk.named_parameters() if n.startswith("layers.")}))
        return b"program"

    monkeypatch.setattr(exporter, "IN_CHILD", False)  # in this process, where its tensors can be counted
    monkeypatch.setattr(lowering, "lower", recorded)
    man = export(deep_moe, tmp_path / "et", target="executorch", quant=QUANT, chunk_layers=2, verify=False)
    assert lowered == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [p["layers"] for p in man["programs"]] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    # the float weights of the quantized projections are gone once quantized; never the model whole (and up to
    # 256 KiB of what else the run creates: rope tables, tokenizer and loader caches)
    assert peak[0] <= outside + 2 * layer + (256 << 10), (peak[0], outside, layer)
    assert peak[0] < plan.quant.total_params * 4 / 2
    assert man["quantized_linears"]["int4"] == 8 * 3 * 3  # every expert projection, in its own layer's program


def test_refused_up_front_when_one_chunk_does_not_fit(deep_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(64 << 20))
    with pytest.raises(BudgetError, match="--chunk-layers"):
        export(deep_moe, tmp_path / "o", target="executorch", quant=QUANT)
    assert not (tmp_path / "o").exists()


def test_programs_lowered_at_once_each_count_in_the_memory_check(deep_moe, tmp_path, monkeypatch):
    """Each program lowered at once is a process holding its chunk: by default as many run as the memory allows (two
    of 2.5 lowerings' worth), and --jobs beyond that is refused up front, naming --jobs."""
    from dataclasses import replace

    from moetool.export.graph import jobs

    monkeypatch.setattr(jobs, "cores", lambda: 4)
    ex, req, plan = plan_export(deep_moe, tmp_path / "o", target="executorch", quant=QUANT, chunk_layers=2)
    one = exporter.executorch_chunks(replace(req, options={**req.options, "jobs": 1}), plan).memory.converting
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(int(2.5 * one)))
    need = ex.need(req, plan)
    assert need.memory == max(2 * one, exporter.executorch_chunks(req, plan).memory.verifying)
    assert "4 programs of up to 2 layers, 2 at once" in need.memory_detail
    with pytest.raises(BudgetError, match=r"--jobs"):
        export(deep_moe, tmp_path / "o", target="executorch", quant=QUANT, chunk_layers=2, jobs=3, verify=False)
    assert not (tmp_path / "o").exists()
