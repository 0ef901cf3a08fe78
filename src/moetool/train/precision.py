"""The dtype and device a stage runs in: the checkpoint's own dtype unless asked otherwise, a GPU when there is one.

Training in a 16-bit dtype keeps the frozen weights (the experts: most of an MoE's bytes) in that dtype and the
trainable ones in float32 (their small updates would round away in bf16: a step of 1e-5 on a weight of 0.05 is below
bf16's resolution). The arithmetic is the device's fast one (:func:`arithmetic_for`): under autocast in the 16-bit
dtype where the device multiplies it natively (a GPU, a CPU with AVX512-BF16 or AMX), else float32 over the 16-bit
weights, one layer upcast at a time (:class:`moetool.compute.upcast.Float32Arithmetic`), which on an AVX2 CPU is
10× faster than PyTorch's fallback bf16 matmul and holds the same bytes. The tuned model is written in the input's
dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moetool.compute.dtypes import dtype_name
from moetool.compute.upcast import Float32Arithmetic, layer_bytes, native_matmul
from moetool.io.budget import Need, human
from moetool.io.checkpoint import Checkpoint
from moetool.quant.roles import role_of
from moetool.recipe.train import TrainSpec


def keep_trainable_float32(model: torch.nn.Module) -> int:
    """Cast the trainable parameters of a 16-bit ``model`` to float32 (the master copy the optimizer updates);
    frozen ones keep their dtype. Returns how many tensors were cast."""
    cast = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
            cast += 1
    return cast


@dataclass
class Arithmetic:
    """How a run computes over weights stored in ``storage``: in ``compute`` (``storage`` under autocast, or
    float32), with ``upcast`` holding the float32-over-16-bit hooks when that is the way."""

    storage: torch.dtype
    compute: torch.dtype
    device: torch.device
    upcast: Float32Arithmetic | None = None
    sharded: bool = False  # FSDP gathers each layer in ``compute`` (its mixed-precision policy), not these hooks

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around a forward pass (and its loss) whose backward will run."""
        if self.upcast is not None:
            with self.upcast.saving():
                yield
        elif self.compute != torch.float32:
            with torch.autocast(device_type=self.device.type, dtype=self.compute):
                yield
        else:
            yield

    def describe(self) -> str:
        """``bfloat16 autocast`` or ``float32 arithmetic over bfloat16 weights (…)``, for the run's first lines."""
        if self.storage == torch.float32:
            return "float32"
        if self.sharded:
            return (
                f"{dtype_name(self.storage)} shards (trainable weights float32; each layer gathered in "
                f"{dtype_name(self.compute)} by FSDP)"
            )
        if self.upcast is None:
            return f"{dtype_name(self.storage)} (trainable weights float32, {dtype_name(self.compute)} autocast)"
        return (
            f"{dtype_name(self.storage)} (trainable weights float32; float32 arithmetic, one layer upcast at a time: "
            f"this {self.device.type.upper()} has no native {dtype_name(self.storage)} matmul)"
        )

    def remove(self) -> None:
        if self.upcast is not None:
            self.upcast.remove()


def arithmetic_for(
    model: torch.nn.Module | None, storage: torch.dtype, device: torch.device, *, sharded: bool = False
) -> Arithmetic:
    """The fast arithmetic for ``model`` (frozen weights in ``storage``, trainable ones float32) on ``device``:
    autocast in ``storage`` where the device multiplies it natively (:func:`moetool.compute.upcast.native_matmul`),
    else float32 arithmetic with one layer upcast at a time (hooks installed on ``model`` here). ``sharded``: the
    model is not built yet and FSDP will gather each layer in the returned ``compute`` dtype."""
    if storage == torch.float32 or native_matmul(storage, device):
        return Arithmetic(storage, storage, device, sharded=sharded)
    if sharded or model is None:
        return Arithmetic(storage, torch.float32, device, sharded=True)
    return Arithmetic(storage, torch.float32, device, Float32Arithmetic(model))


def _is_expert(name: str) -> bool:
    """A routed expert's tensor, by the roles the quantization plans use (a name no role knows is not one)."""
    try:
        return role_of(name) == "experts"
    except ValueError:
        return False


@dataclass(frozen=True)
class Launch:
    """The processes a run is launched as: ``processes`` in all, ``local`` of them on this machine, ``sharded``
    when each holds a slice of every weight (FSDP2) rather than the whole model (one process, DDP)."""

    processes: int = 1
    local: int = 1
    sharded: bool = False


def tuning_need(
    model_dir: Path, spec: TrainSpec, preset: str | None, dtype: torch.dtype, output: Path, launch: Launch = Launch()
) -> Need:
    """Peak memory (of this machine's processes together) and bytes written of router tuning ``model_dir`` in
    ``dtype``, from its config and headers.

    Weights in ``dtype``; the trainable ones (every tensor but the experts; all under the ``full`` preset or the
    user's own patterns, an upper bound) also as
    float32 masters with a gradient and two AdamW moments; activations of one micro-batch (``batch_size`` ×
    ``seq_len`` tokens: hidden states and expert intermediates per layer, and three float32 copies of the logits);
    a fixed allowance for the runtime. Sharded over ``launch.processes``, each process holds its slice of the
    weights and optimizer state, plus one decoder layer gathered in float32. On disk: the tuned model in ``dtype``
    and the resumable checkpoint.
    """
    ck = Checkpoint(Path(model_dir))
    cfg = ck.config
    total = sum(t.numel for t in ck.tensors.values())
    experts = sum(t.numel for n, t in ck.tensors.items() if _is_expert(n))
    trainable = total - experts if preset in ("mofe", "router_only") else total
    width = dtype.itemsize
    weights = total * width + (trainable * 4 if width != 4 else 0)
    optimizer = trainable * 12  # gradient + two AdamW moments, float32
    tokens = spec.batch_size * spec.seq_len
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 4 * hidden)
    top_k = int(cfg.get("num_experts_per_tok") or 1)
    acts = tokens * layers * (hidden * 40 + inter * top_k * 12) + tokens * int(cfg["vocab_size"]) * 4 * 3
    runtime = 512 << 20
    gathered = 0
    if launch.sharded:
        weights, optimizer = weights // launch.processes, optimizer // launch.processes
        gathered = layer_bytes(cfg, total)[1]
    detail = (
        f"weights {human(weights)} in {dtype_name(dtype)}"
        f"{' + float32 trainable copies' if width != 4 else ''}, optimizer {human(optimizer)}, activations "
        f"{human(acts)} at {spec.batch_size}×{spec.seq_len} tokens"
    )
    if launch.sharded:
        detail += f", one layer gathered {human(gathered)}: per process, 1/{launch.processes} of the model"
    if launch.local > 1:
        detail += f"; × {launch.local} processes on this machine"
    way_out = (
        "Tune in bfloat16 (--dtype bfloat16), lower train.batch_size or train.seq_len (raise grad_accum to keep the "
        "batch), use a GPU (--device cuda), or another machine"
    )
    return Need(
        stage="router tuning",
        memory=(weights + optimizer + gathered + acts + runtime) * launch.local,
        memory_detail=detail,
        disk=total * width + trainable * 12,
        output=Path(output),
        way_out=way_out,
    )
