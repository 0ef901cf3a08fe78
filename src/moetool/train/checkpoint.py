"""Resumable state of a router-tuning run: trainable tensors, AdamW moments and counters, no pickle.

A checkpoint holds whole tensors and the step, nothing about processes: the batches of a step are a pure function
of (seed, step), so a run resumes with any process count (:mod:`moetool.train.distributed`), sharded or not
(:mod:`moetool.train.sharded`: shards are gathered to write and cut again on resume).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NotRequired, TypedDict

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moetool.errors import MoetoolError
from moetool.io.safe import read_json
from moetool.train.sharded import full, place

CHECKPOINT_FORMAT = 1


class StepRecord(TypedDict):
    """One logged optimizer step of router tuning: the ``history`` a checkpoint, ``moetool.json`` and the result keep.

    Losses and rates are means over the step's global batch; ``tokens`` its size. A step that observed the routing
    (every ``log_every``-th and the last) also has the routing entropy, the experts' loads and the throughput.
    """

    step: int
    loss: float
    ce: float
    lb: float
    z: float
    lr: float
    tokens: int
    entropy: NotRequired[float]
    load: NotRequired[list[float]]
    tokens_per_s: NotRequired[float]


def model_content_key(model_dir: Path) -> str:
    """A key of a model folder's content, cheap to compute at any size: config.json and, for every weight file, its
    name, size and safetensors header (every tensor's name, dtype, shape and offsets).

    A checkpoint keyed by it is not resumed onto another model merged into the same path (one more expert, other
    experts), which a key of the path alone allowed.
    """
    import hashlib

    from moetool.io.checkpoint import Checkpoint

    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for f in Checkpoint(Path(model_dir)).weight_files:
        h.update(f"\0{f.name}\0{f.stat().st_size}\0".encode())
        with f.open("rb") as fh:
            head = fh.read(8)
            if f.suffix == ".safetensors" and len(head) == 8:
                h.update(fh.read(min(int.from_bytes(head, "little"), 100_000_000)))
    return h.hexdigest()


def checkpoint_dir(output: Path) -> Path:
    """Where a run writing ``output`` keeps its resumable state (removed after success)."""
    return output.parent / f".{output.name}.moetool-train"


def save_checkpoint(
    ckpt: Path,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    history: list[StepRecord],
    fingerprint: str,
    *,
    write: bool = True,
) -> None:
    """Trainable tensors and AdamW moments as safetensors, counters as JSON. Written atomically (a finished
    temporary folder renamed into place) by the process with ``write``; every process calls this (a sharded
    model's tensors are gathered from all of them)."""
    names = {p: n for n, p in model.named_parameters() if p.requires_grad}
    tensors = {n: full(p).contiguous() for p, n in names.items()}
    moments: dict[str, torch.Tensor] = {}
    for p, n in names.items():
        for k, v in opt.state.get(p, {}).items():
            moments[f"{n}::{k}"] = full(v if torch.is_tensor(v) else torch.tensor(v)).contiguous()
    if not write:
        return
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "trainable.safetensors"))
    save_file(moments, str(tmp / "optimizer.safetensors"))
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "scheduler": sched.state_dict(),
        "history": history,
        "fingerprint": fingerprint,
    }
    (tmp / "state.json").write_text(json.dumps(state))
    shutil.rmtree(ckpt, ignore_errors=True)
    tmp.rename(ckpt)


def load_checkpoint(
    ckpt: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    fingerprint: str,
) -> tuple[int, list[StepRecord]]:
    """Restore tensors, moments and schedule in place; returns (step, history).

    Raises:
        MoetoolError: the checkpoint is unreadable or belongs to another run (recipe, model or freeze changed).
    """
    try:
        state = read_json(ckpt / "state.json", what="router-tuning checkpoint state", error=MoetoolError)
    except MoetoolError as exc:
        raise MoetoolError(f"{exc}; pass --no-resume to start over") from None
    if state.get("format") != CHECKPOINT_FORMAT or state.get("fingerprint") != fingerprint:
        raise MoetoolError(
            f"{ckpt} belongs to a different run (recipe, model or freeze changed); pass --no-resume to start over"
        )
    params = dict(model.named_parameters())
    try:  # a file cut short by a kill or a full disk, or tensors of another shape: the checkpoint is unusable
        with torch.no_grad():
            for n, t in load_file(str(ckpt / "trainable.safetensors")).items():
                params[n].copy_(place(t, params[n]))
        moments = load_file(str(ckpt / "optimizer.safetensors"))
        sched.load_state_dict(state["scheduler"])
        step, history = int(state["step"]), list(state["history"])
    except (SafetensorError, OSError, KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise MoetoolError(f"{ckpt}: the checkpoint is incomplete or corrupt ({exc}); pass --no-resume") from None
    for n, p in params.items():
        # a moment shaped like its parameter is sharded like it; the step count is a plain scalar
        st = {
            k.split("::", 1)[1]: place(v, p) if v.shape == p.shape else v.to(p.device)
            for k, v in moments.items()
            if k.split("::", 1)[0] == n
        }
        if st:
            opt.state[p] = st
    # the scheduler writes the lr into the optimizer only when it steps; restore the lr it last set
    for group, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
        group["lr"] = lr
    return step, history
