"""Router tuning over two CPU processes (gloo) under ``accelerate launch``: the same routers as one process with the
same global batch, and a run resumes under another process count (2 → 1, 1 → 2)."""

from __future__ import annotations

import json

import pytest
from launch_fixtures import CONFIGS, launch, max_router_diff

from moetool.errors import MoetoolError
from moetool.recipe import load_recipe
from moetool.train.distributed import local_micro_batches, make_accelerator
from moetool.train.router_tuning import checkpoint_dir, train_router

CONFIG = CONFIGS / "cpu_multi_process.yaml"
# float summation order differs (DDP's all-reduce of two means vs one accumulated sum) and Adam divides by √v, so
# single-ulp gradient differences grow a little over the steps; measured max |Δ| is below 1e-6
ATOL = 1e-5


def _stop_after_3(step, _metrics):
    if step == 3:
        raise KeyboardInterrupt


@pytest.fixture(scope="module")
def launched(moe, tmp_path_factory):
    """One two-process launch (launch_worker.py): a CLI run resuming a one-process checkpoint of step 2, an
    uninterrupted run, and a run stopped after step 3. Returns (log, resumed, uninterrupted, stopped)."""
    recipe, model, _ = moe
    d = tmp_path_factory.mktemp("launched")
    with pytest.raises(KeyboardInterrupt):
        train_router(load_recipe(recipe), model, d / "resumed", callback=_stop_after_3)
    log = launch(CONFIG.name, str(recipe), str(model), str(d / "resumed"), str(d / "two"), str(d / "stopped"))
    assert "stopped after step 3" in log
    return log, d / "resumed", d / "two", d / "stopped"


def test_micro_batches_are_split_not_repeated():
    for n in (1, 2, 4):
        shares = [local_micro_batches(8, p, n) for p in range(n)]
        assert sorted(i for s in shares for i in s) == list(range(8))


def _fake_launch(monkeypatch, kind: str) -> None:
    """Two processes as far as make_accelerator can tell, with ``kind`` as the Accelerator's distributed type."""
    import accelerate

    class TwoProcesses:
        def __init__(self, cpu: bool) -> None:
            self.num_processes = 2

    class Sharded:
        def __init__(self, cpu: bool, gradient_accumulation_steps: int) -> None:
            self.distributed_type = accelerate.DistributedType[kind]

    monkeypatch.setattr(accelerate, "PartialState", TwoProcesses)
    monkeypatch.setattr(accelerate, "Accelerator", Sharded)
    # as torchrun sets them for each process it starts (a bare WORLD_SIZE is refused: no launcher started the others)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)


def test_grad_accum_must_split_over_processes(monkeypatch):
    _fake_launch(monkeypatch, "MULTI_CPU")
    with pytest.raises(MoetoolError, match=r"grad_accum \(3\) must be a multiple of the process count \(2\)"):
        make_accelerator(3)
    assert make_accelerator(4).distributed_type == "MULTI_CPU"


def test_deepspeed_is_refused_with_the_reason(monkeypatch):
    _fake_launch(monkeypatch, "DEEPSPEED")
    with pytest.raises(MoetoolError, match="DeepSpeed ZeRO-3 is not supported: accelerate runs DeepSpeed only on"):
        make_accelerator(2)


def test_example_configs_parse():
    from accelerate.commands.config.config_args import load_config_from_file

    kinds = {
        f.stem: str(load_config_from_file(str(f)).distributed_type).split(".")[-1] for f in CONFIG.parent.glob("*.yaml")
    }
    assert kinds == {
        "cpu_multi_process": "MULTI_GPU",  # accelerate's torchrun launcher; moetool makes it gloo on CPUs
        "one_gpu": "NO",
        "multi_gpu": "MULTI_GPU",
        "fsdp": "FSDP",
        "fsdp_cpu": "FSDP",  # moetool shards the model itself, on CPUs as on GPUs
    }


def test_two_processes_equal_one(moe, launched):
    recipe, _, one = moe
    _, _, two, _ = launched
    diff = max_router_diff(one, two)
    print(f"max |Δ router| 1 vs 2 processes: {diff:.3g}")
    assert diff <= ATOL
    meta_one = json.loads((one / "moetool.json").read_text())["training"]
    meta_two = json.loads((two / "moetool.json").read_text())["training"]
    assert (meta_one["processes"], meta_two["processes"]) == (1, 2)
    spec = load_recipe(recipe).train
    global_batch = spec.batch_size * spec.seq_len * spec.grad_accum
    for h1, h2 in zip(meta_one["history"], meta_two["history"], strict=True):
        # split, not repeated: the two processes' tokens add up to the global batch, not twice it
        assert h1["tokens"] == h2["tokens"] == global_batch
        # logged losses and loads are the whole global batch's (reduced over processes), not one process's half
        assert h1["loss"] == pytest.approx(h2["loss"], abs=1e-5)
        assert h1["load"] == pytest.approx(h2["load"], abs=1e-6)
    assert not checkpoint_dir(two).exists()


def test_resume_two_to_one(moe, launched):
    recipe, model, one = moe
    out = launched[3]
    assert not out.exists() and checkpoint_dir(out).exists()
    res = train_router(load_recipe(recipe), model, out)
    assert res.resumed_from == 2
    diff = max_router_diff(one, out)
    print(f"max |Δ router| resumed 2 → 1 vs 1 process: {diff:.3g}")
    assert diff <= ATOL


def test_resume_one_to_two_from_the_cli(moe, launched):
    _, _, one = moe
    log, out = launched[0], launched[1]
    assert "resuming from step 2" in log and "processes: 2 (MULTI_CPU)" in log
    assert log.count("wrote") == 1, "only the main process reports"
    assert not checkpoint_dir(out).exists()
    diff = max_router_diff(one, out)
    print(f"max |Δ router| resumed 1 → 2 vs 1 process: {diff:.3g}")
    assert diff <= ATOL
