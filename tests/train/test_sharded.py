"""Router tuning sharded with FSDP2 over two CPU processes (gloo) under ``accelerate launch``: each process holds
half of every weight, the routers equal one process's, and a run resumes under another process count
(2 → 1, 1 → 2), as the data-parallel tests show for DDP."""

from __future__ import annotations

import json
import re

import pytest
from launch_fixtures import launch, max_router_diff
from safetensors import safe_open

from moetool.errors import MoetoolError
from moetool.recipe import load_recipe
from moetool.train.router_tuning import checkpoint_dir, train_router
from moetool.train.sharded import fsdp_requested

# the tolerance of the DDP tests: FSDP's reduce-scatter sums in another order than one process's accumulation
ATOL = 1e-5


def _stop_after_3(step, _metrics):
    if step == 3:
        raise KeyboardInterrupt


@pytest.fixture(scope="module")
def sharded(moe, tmp_path_factory):
    """One FSDP launch (launch_worker.py): a CLI run resuming a one-process checkpoint of step 2, an uninterrupted
    run, a run stopped after step 3. Returns (log, resumed, uninterrupted, stopped)."""
    recipe, model, _ = moe
    d = tmp_path_factory.mktemp("sharded")
    with pytest.raises(KeyboardInterrupt):
        train_router(load_recipe(recipe), model, d / "resumed", callback=_stop_after_3)
    log = launch("fsdp_cpu.yaml", str(recipe), str(model), str(d / "resumed"), str(d / "two"), str(d / "stopped"))
    assert "stopped after step 3" in log
    return log, d / "resumed", d / "two", d / "stopped"


def test_each_process_holds_half_of_the_weights(sharded):
    held = [tuple(map(int, m)) for m in re.findall(r"rank \d holds (\d+) of (\d+) frozen weights", sharded[0])]
    assert len(held) == 2, sharded[0][-2000:]
    total = held[0][1]
    assert sum(h for h, _ in held) == total  # split, not replicated
    assert all(h <= total / 2 + 64 for h, _ in held)  # a row of padding at most


def test_two_sharded_processes_equal_one(moe, sharded):
    _, _, one = moe
    two = sharded[2]
    diff = max_router_diff(one, two)
    print(f"max |Δ router| 1 process vs 2 FSDP processes: {diff:.3g}")
    assert diff <= ATOL
    record = json.loads((two / "moetool.json").read_text())["training"]
    assert (record["processes"], record["layout"], len(record["peak_rss_gb"])) == (2, "fsdp2", 2)
    assert not checkpoint_dir(two).exists()


def test_frozen_experts_are_copied_bit_for_bit(moe, sharded):
    _, model, _ = moe
    with (
        safe_open(str(model / "model.safetensors"), "pt") as a,
        safe_open(str(sharded[2] / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        experts = [k for k in a.keys() if ".experts." in k]  # noqa: SIM118
        assert experts and all(a.get_tensor(k).equal(b.get_tensor(k)) for k in experts)


def test_resume_sharded_two_to_one(moe, sharded):
    recipe, model, one = moe
    out = sharded[3]
    assert not out.exists() and checkpoint_dir(out).exists()
    res = train_router(load_recipe(recipe), model, out)
    assert res.resumed_from == 2
    diff = max_router_diff(one, out)
    print(f"max |Δ router| resumed FSDP 2 → 1 vs 1 process: {diff:.3g}")
    assert diff <= ATOL


def test_resume_one_to_two_sharded_from_the_cli(moe, sharded):
    _, _, one = moe
    log, out = sharded[0], sharded[1]
    assert "resuming from step 2" in log and "processes: 2 (FSDP2, each holding 1/2 of every weight)" in log
    assert log.count("wrote") == 1, "only the main process reports"
    diff = max_router_diff(one, out)
    print(f"max |Δ router| resumed 1 → 2 FSDP vs 1 process: {diff:.3g}")
    assert diff <= ATOL


def test_fsdp_version_1_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(MoetoolError, match="set fsdp_config.fsdp_version: 2"):
        fsdp_requested()
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert fsdp_requested()


def test_the_memory_check_counts_a_slice_per_process_and_every_process_here(moe, monkeypatch):
    """The up-front check sizes one process's slice under FSDP (the weights and optimizer state over the process
    count, plus one gathered layer), and counts every process on this machine: DDP's replicas all hold the model."""
    import torch

    from moetool.io.budget import BudgetError
    from moetool.train.precision import Launch, tuning_need

    recipe, model, _ = moe
    spec = load_recipe(recipe).train
    need = {
        launch: tuning_need(model, spec, "mofe", torch.float32, model.parent / "out", launch).memory
        for launch in (Launch(), Launch(2, 1, True), Launch(4, 1, True), Launch(2, 2, False), Launch(2, 2, True))
    }
    one, half, quarter, ddp2, fsdp2 = need.values()
    assert quarter < half < one and fsdp2 == 2 * half < ddp2 == 2 * one
    # at a budget two slices fit in but two replicas do not, the DDP launch is refused up front and FSDP is not
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str((fsdp2 + ddp2) // 2))
    with pytest.raises(BudgetError, match=r"router tuning needs about .*× 2 processes on this machine"):
        tuning_need(model, spec, "mofe", torch.float32, model.parent / "out", Launch(2, 2, False)).check()
    tuning_need(model, spec, "mofe", torch.float32, model.parent / "out", Launch(2, 2, True)).check()
