"""How router tuning spreads over processes (``accelerate launch``, ``torchrun``): data-parallel (DDP), one model
replica per process, or sharded (FSDP2, :mod:`moetool.train.sharded`), each process holding a slice of every
weight; either way the global batch is split into whole micro-batches.

The invariant is the global batch of one optimizer step: ``grad_accum`` micro-batches of ``batch_size`` rows, the
same rows whatever the process count. Process ``p`` of ``n`` runs micro-batches ``p·g/n … (p+1)·g/n - 1``
(``g = grad_accum``) and accumulates ``g/n`` of them; DDP averages the gradients. A micro-batch is never cut in rows
because the load-balancing loss and the router jitter are functions of a whole micro-batch: splitting one would
change the loss, not just its summation order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from moetool.errors import MoetoolError
from moetool.train.precision import Launch

# the process layouts accelerate sets up for moetool: one process, or a group whose model moetool replicates (DDP)
# or shards itself (FSDP2); DeepSpeed and Megatron would own the model and its checkpoints
_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU")
_WHY_NOT = {
    "DEEPSPEED": "DeepSpeed ZeRO-3 is not supported: accelerate runs DeepSpeed only on accelerators (never on CPUs, "
    "so it cannot be tested where moetool is built), and ZeRO-3 would own the model and its checkpoints. FSDP "
    "shards the same way: launch with examples/accelerate/fsdp.yaml",
}
# what a launcher sets for each process it starts: the process count, and the rank torch.distributed's rendezvous
# needs beside the rank 0 address (torchrun and accelerate set RANK and MASTER_ADDR; MPI its own rank)
_WORLD_SIZES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_RANKS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
# the backends accelerate's launcher selects by a variable (and the variables that describe them), which would own
# the model: accelerate imports their package first and fails with its own traceback where it is missing, so moetool
# reads these before accelerate does
_OWNED = {
    "DEEPSPEED": ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
    "MEGATRON_LM": ("ACCELERATE_USE_MEGATRON_LM",),
}


def _world_size_var() -> tuple[str, int]:
    """The variable a launcher gave the process count in (torchrun and accelerate: ``WORLD_SIZE``; MPI its own),
    and the count; ``("", 1)`` without one."""
    for name in _WORLD_SIZES:
        if os.environ.get(name, "").isdigit():
            return name, int(os.environ[name])
    return "", 1


def _launched_world_size() -> int:
    """The process count a launcher asked for."""
    return _world_size_var()[1]


def check_launch() -> None:
    """Refuse a launch accelerate would fail on with a traceback of its own, before it reads the environment.

    Raises:
        MoetoolError: the launch asks for DeepSpeed or Megatron-LM (backends that own the model), or for several
            processes (``WORLD_SIZE`` > 1) that no launcher started (no rank, no rank 0 address).
    """
    from accelerate.utils import parse_flag_from_env

    for kind, (flag, *more) in _OWNED.items():
        if parse_flag_from_env(flag):
            asked = ", ".join(f"{v}={os.environ[v]}" for v in (flag, *more) if v in os.environ)
            raise MoetoolError(
                f"the launch asks for {kind} ({asked}, as `accelerate launch` sets for --use_{kind.lower()} or a "
                f"config with distributed_type: {kind}): {_refusal(kind)}"
            )
    name, n = _world_size_var()
    wanted = {"RANK": _RANKS, "MASTER_ADDR": ("MASTER_ADDR",)}
    missing = [v for v, names in wanted.items() if not any(os.environ.get(x) for x in names)]
    if n > 1 and missing:
        raise MoetoolError(
            f"{name}={n} asks for {n} processes, but no launcher started them ({' and '.join(missing)} not set, which "
            f"a launcher sets for each process it starts): launch with `torchrun --nproc-per-node {n} --no-python "
            f"moetool train …` or `accelerate launch --num_processes {n} --no_python moetool train …` "
            f"(examples/accelerate/README.md), or unset {name} to train in this one process"
        )


def _cpu_only() -> bool:
    """True when asked for CPUs (``ACCELERATE_USE_CPU``) or launched as several processes with no accelerator.

    accelerate's ``--multi_gpu`` (torchrun) launch on a machine without GPUs gives every process a world of its own
    unless the Accelerator is told ``cpu=True``; then the processes join one gloo group.
    """
    from accelerate.utils import parse_flag_from_env

    asked = parse_flag_from_env("ACCELERATE_USE_CPU")
    return asked or (_launched_world_size() > 1 and not torch.accelerator.is_available())


def launch_of(sharded: bool) -> Launch:
    """The launch as its launcher describes it (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), before the group forms."""
    n = _launched_world_size()
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return Launch(processes=n, local=int(local) if local.isdigit() else n, sharded=sharded)


def single_cpu_launch() -> bool:
    """True under ``accelerate launch --cpu --num_processes N`` (N > 1) without MPI: that launcher starts one
    process (it sets the rendezvous address for N but no world size), so the run is correct but not parallel."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ and _launched_world_size() == 1


def make_accelerator(grad_accum: int, *, device: torch.device | None = None, sharded: bool = False) -> Any:
    """The run's Accelerator, accumulating this process's share (``grad_accum / num_processes``) of micro-batches.

    ``device`` (a single-process run's ``--device``): the CPU even where a GPU is, or that CUDA device; None: what
    the launch gives (a GPU when there is one). ``sharded``: the launch asked for FSDP, which moetool applies
    itself (:mod:`moetool.train.sharded`); accelerate then only forms the group and accumulates.

    Raises:
        MoetoolError: ``train.grad_accum`` is not a multiple of the process count; several processes asked for
            that no launcher started, or that did not join one group; the backend owns the model (DeepSpeed,
            Megatron), refused before accelerate reads the launch (:func:`check_launch`).
    """
    check_launch()
    from accelerate import Accelerator, PartialState

    cpu = _cpu_only() or (device is not None and device.type == "cpu")
    if device is not None and device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
    state = PartialState(cpu=cpu)
    n, wanted = state.num_processes, _launched_world_size()
    if wanted > 1 and n != wanted:
        raise MoetoolError(
            f"launched as {wanted} processes but accelerate sees {n}: each would train alone on the whole batch "
            "(see examples/accelerate/README.md for launch commands that form one group)"
        )
    if grad_accum % n:
        raise MoetoolError(
            f"train.grad_accum ({grad_accum}) must be a multiple of the process count ({n}): the global batch "
            f"(batch_size × grad_accum rows) is split over processes in whole micro-batches; set grad_accum to "
            f"{n * -(-grad_accum // n)} (and lower batch_size to keep the global batch), or launch a number of processes "
            f"that divides {grad_accum}"
        )
    with _fsdp_hidden(sharded):
        accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=grad_accum // n)
    # the Accelerator, not the PartialState, knows a backend plugin (FSDP, DeepSpeed) from the launch config
    kind = str(accelerator.distributed_type).split(".")[-1]
    if kind not in _SUPPORTED:
        raise MoetoolError(_refusal(kind))
    return accelerator


def _refusal(kind: str) -> str:
    """Why router tuning does not run under accelerate's ``kind`` of launch (DeepSpeed, Megatron-LM, …)."""
    why = _WHY_NOT.get(kind, f"router tuning runs on one process, data-parallel (DDP) or FSDP2 ones, not {kind}")
    return why + " (examples/accelerate/README.md)"


@contextlib.contextmanager
def _fsdp_hidden(hide: bool) -> Iterator[None]:
    """accelerate's FSDP switch off while the Accelerator is made: moetool shards the model itself."""
    saved = os.environ.pop("ACCELERATE_USE_FSDP", None) if hide else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_FSDP"] = saved


def local_micro_batches(grad_accum: int, process_index: int, num_processes: int) -> range:
    """The global indices (within one optimizer step) of the micro-batches this process runs."""
    share = grad_accum // num_processes
    return range(process_index * share, (process_index + 1) * share)


def reduce_sum(accelerator: Any, values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over processes (itself on one process), on the CPU. ``values``: ``[K]``."""
    return accelerator.reduce(values.to(accelerator.device), reduction="sum").cpu()  # type: ignore[no-any-return]


def process_record(accelerator: Any, sharded: bool) -> dict[str, Any]:
    """The launch for the tuned model's ``moetool.json``: process count, layout, and each process's peak resident
    memory so far in GB (gathered from all: the figure that shows what sharding saves)."""
    import resource
    import sys

    # ru_maxrss is in kilobytes on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    peaks = accelerator.gather(torch.tensor([peak / 1e9], dtype=torch.float64, device=accelerator.device))
    n = accelerator.num_processes
    layout = "fsdp2" if sharded else ("ddp" if n > 1 else "single")
    return {"processes": n, "layout": layout, "peak_rss_gb": [round(float(x), 3) for x in peaks.cpu()]}
