"""A launch accelerate cannot run is refused by ``moetool train`` with a sentence naming the launcher, before
accelerate reads the environment (it failed with its own traceback): several processes asked for (``WORLD_SIZE``)
that no launcher started, and DeepSpeed or Megatron-LM, which would own the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tuning_fixtures import write_tuning_recipe

from moetool.errors import MoetoolError
from moetool.train.distributed import check_launch

ROOT = Path(__file__).resolve().parents[2]
# every variable a launcher sets that these tests set or must not inherit from the shell running them
LAUNCH_VARS = (
    "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_SIZE", "PMI_RANK",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK",
    "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_USE_MEGATRON_LM", "ACCELERATE_USE_CPU",
    "ACCELERATE_USE_FSDP",
)  # fmt: skip
# what `accelerate launch --use_deepspeed --zero_stage 3` gives its one process (torchrun's rendezvous included)
DEEPSPEED_PROCESS = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    "WORLD_SIZE": "1",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29511",
}
ZERO3 = (
    "the launch asks for DEEPSPEED (ACCELERATE_USE_DEEPSPEED=true, ACCELERATE_DEEPSPEED_ZERO_STAGE=3, as `accelerate "
    "launch` sets for --use_deepspeed or a config with distributed_type: DEEPSPEED): DeepSpeed ZeRO-3 is not "
    "supported: accelerate runs DeepSpeed only on accelerators"
)
NO_LAUNCHER = (
    "WORLD_SIZE=2 asks for 2 processes, but no launcher started them (RANK and MASTER_ADDR not set, which a launcher "
    "sets for each process it starts): launch with `torchrun --nproc-per-node 2 --no-python moetool train …` or "
    "`accelerate launch --num_processes 2 --no_python moetool train …`"
)


@pytest.fixture(scope="module")
def merged(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tuning recipe, the MoE it merges): what ``moetool train`` is given."""
    from moetool.api import assemble

    d = tmp_path_factory.mktemp("launch")
    recipe = write_tuning_recipe(d, tiny_models("llama"), steps=2)
    return recipe, assemble(recipe, d / "moe")


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"WORLD_SIZE": "2"}, NO_LAUNCHER),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, ZERO3),
        (DEEPSPEED_PROCESS, ZERO3),
    ],
    ids=["world-size-without-launcher", "zero3", "zero3-launched-process"],
)
def test_moetool_train_refuses_the_launch_by_name_without_a_traceback(merged, tmp_path, env, said):
    recipe, model = merged
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    run_env = clean | env | {"PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    moetool = Path(sys.executable).parent / "moetool"
    cmd = [str(moetool), "train", str(recipe), "--model", str(model), "-o", str(tmp_path / "tuned")]
    proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert said in " ".join(output.split()), output[-3000:]
    assert "Traceback" not in output and "╭" not in output, output[-3000:]
    assert not (tmp_path / "tuned").exists()


@pytest.fixture()
def launch_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"WORLD_SIZE": "1"},
        # torchrun's process, and accelerate's MPI launch of CPU processes (its own rank variable)
        {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        {"PMI_SIZE": "2", "PMI_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        {"ACCELERATE_USE_DEEPSPEED": "false", "ACCELERATE_USE_FSDP": "true"},
    ],
    ids=["alone", "world-of-one", "torchrun", "mpi", "fsdp"],
)
def test_a_launcher_started_process_passes(launch_env, env):
    for k, v in env.items():
        launch_env.setenv(k, v)
    check_launch()


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1"}, "WORLD_SIZE=4 asks for 4 processes, but no launcher started "
         "them (RANK not set"),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE=2 asks for 2 processes, "
         "but no launcher started them (MASTER_ADDR not set"),
        ({"ACCELERATE_USE_DEEPSPEED": "1", "WORLD_SIZE": "2"}, "the launch asks for DEEPSPEED "
         "(ACCELERATE_USE_DEEPSPEED=1, as `accelerate launch` sets for --use_deepspeed"),
        ({"ACCELERATE_USE_MEGATRON_LM": "true"}, "the launch asks for MEGATRON_LM (ACCELERATE_USE_MEGATRON_LM=true, "
         "as `accelerate launch` sets for --use_megatron_lm or a config with distributed_type: MEGATRON_LM): router "
         "tuning runs on one process, data-parallel (DDP) or FSDP2 ones, not MEGATRON_LM"),
    ],
    ids=["no-rank", "mpi-without-address", "deepspeed-first", "megatron"],
)  # fmt: skip
def test_each_refusal_names_what_the_launch_lacks_or_asks_for(launch_env, env, said):
    for k, v in env.items():
        launch_env.setenv(k, v)
    with pytest.raises(MoetoolError) as caught:
        check_launch()
    assert said in str(caught.value)
