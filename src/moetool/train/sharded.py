"""Router tuning sharded over processes with FSDP2 (``fully_shard``): each process holds ``1/N`` of every weight.

A launch asks for it with accelerate's FSDP config (``distributed_type: FSDP``, ``fsdp_version: 2``;
``examples/accelerate/fsdp*.yaml``). moetool shards the model itself rather than through ``accelerator.prepare``,
because accelerate runs FSDP only on accelerators (on CPUs its state falls back to data-parallel) and because it
would load the whole model first: here the model is built on ``meta`` and each decoder layer is read from the
checkpoint, sharded and its full copy dropped before the next is read, so no process ever holds more than its
shard plus one layer. Each decoder layer is one FSDP unit, everything outside the layer stack (embeddings, final
norm, head) the root unit.

Precision: weights keep their checkpoint dtype in the shards, the trainable ones in float32 (master weights, as
in a one-process run); FSDP's mixed-precision policy gathers a layer in the run's compute dtype (float32 over
bf16 on a CPU without native bf16 matmul, as :mod:`moetool.compute.upcast` does on one process) and reduces
gradients in float32.

Checkpoints and the output hold whole tensors, as a one-process run writes them: every process takes part in
gathering each trainable tensor (:func:`full`), the main one writes, and on resume each process keeps its slice of
the whole tensor read back (:func:`place`), so a run resumes under any process count.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from moetool.errors import MoetoolError
from moetool.train.freeze import FreezeReport, apply_freeze
from moetool.train.precision import keep_trainable_float32

__all__ = ["fsdp_requested", "full", "load_sharded", "place"]


def fsdp_requested() -> bool:
    """True when the launch config asks for FSDP (accelerate's launcher sets ``ACCELERATE_USE_FSDP``).

    Raises:
        MoetoolError: the config asks for FSDP version 1 (its flat parameters mix frozen and trainable weights).
    """
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return False
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise MoetoolError(
            f"router tuning shards with FSDP2 (fully_shard); the launch config asks for fsdp_version {version}: "
            "set fsdp_config.fsdp_version: 2 (examples/accelerate/fsdp.yaml)"
        )
    return True


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU: gathered from every process when ``t`` is a shard (every process must call
    this, in the same order), else ``t`` itself, detached."""
    from torch.distributed.tensor import DTensor

    whole = t.full_tensor() if isinstance(t, DTensor) else t
    return whole.detach().cpu()


def place(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``like``: this process's slice when ``like`` is a shard, else ``whole`` on its device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    whole = whole.to(like.dtype)
    if not isinstance(like, DTensor):
        return whole.to(like.device)

    # every process holds the whole tensor (read from the checkpoint), so each cuts its own slice: no collective
    return distribute_tensor(
        whole.to(like.device_mesh.device_type), like.device_mesh, like.placements, src_data_rank=None
    )


def any_process(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is true on any process (the processes then all stop together)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t)
    return bool(t.item() > 0)


def _keep_flags(named: Iterable[tuple[str, torch.nn.Parameter]], trainable: set[str]) -> None:
    """After a load replaced these parameters: the freeze report's trainable ones train, the rest are frozen."""
    for name, p in named:
        p.requires_grad_(name in trainable)


def _even_split(processes: int) -> Any:
    """FSDP's placement for each weight: along its first dimension that ``processes`` divides (fused experts are
    ``[E, 2I, H]``: 3 experts over 2 processes would split 2:1 along the first), else the first (padded)."""
    from torch.distributed.tensor import Shard

    def placement(p: torch.nn.Parameter) -> Any:
        dim = next((d for d, size in enumerate(p.shape) if size % processes == 0), 0)
        return Shard(dim)

    return placement


def load_sharded(
    model_dir: Path,
    storage: torch.dtype,
    compute: torch.dtype,
    freeze: tuple[str | None, list[str], list[str]],
    device: torch.device,
    processes: int,
) -> tuple[Any, FreezeReport]:
    """The causal LM in ``model_dir`` sharded over ``processes`` FSDP2 processes, read one decoder layer at a time.

    ``freeze`` is (preset, trainable patterns, frozen patterns) as the recipe's ``freeze:``. Call it in every
    process of the group, after the process group exists.

    Returns:
        (the sharded model in train mode, the freeze report).

    Raises:
        MoetoolError: the checkpoint does not hold a parameter of the model; the freeze patterns do not fit.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from moetool.compute.stream import give_back_freed_memory, meta_causal_lm

    meta = meta_causal_lm(model_dir, storage)
    model = meta.model
    report = apply_freeze(model, *freeze)
    trainable = set(report.trainable)
    mesh = init_device_mesh(device.type, (processes,))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for i, layer in enumerate(meta.layers):
        meta.loader.load(meta.layer_keys.get(i, []))
        prefix = f"{meta.prefix}.{i}."
        unread = [n for n, p in layer.named_parameters() if p.is_meta]
        if unread:
            raise MoetoolError(f"{model_dir}: the checkpoint does not hold {prefix}{unread[0]}")
        _keep_flags(((prefix + n, p) for n, p in layer.named_parameters()), trainable)
        keep_trainable_float32(layer)
        layer.to(device)
        # the whole layer is dropped here: each process keeps its slice only
        fully_shard(layer, mesh=mesh, mp_policy=policy, shard_placement_fn=_even_split(processes))
        give_back_freed_memory()  # the dropped copy's many small pieces would otherwise stay in the heap
    meta.load_outside()
    inside = {id(p) for p in meta.layers.parameters()}
    _keep_flags(((n, p) for n, p in model.named_parameters() if id(p) not in inside), trainable)
    keep_trainable_float32(model)  # the layers' trainable slices are float32 already
    torch.nn.Module.to(model, device)  # (transformers' own ``to`` is typed for dtypes)
    fully_shard(model, mesh=mesh, mp_policy=policy, shard_placement_fn=_even_split(processes))
    model.train()
    return model, report
