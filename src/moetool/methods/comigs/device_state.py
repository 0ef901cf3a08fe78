"""A device's private CoMiGS state on disk: specialists, routers, attention LoRA (when not shared), both optimisers'
moments and the counters, written once per completed round.

A Flower SuperNode keeps ``context.state`` in memory only, so a SuperNode that dies takes its user's specialists and
router with it. With ``state-dir`` in the SuperNode's ``--node-config`` the ClientApp also writes them here, after the
round's local training has finished and before its reply leaves. The write is atomic (a temporary sibling, fsynced,
then renamed over the file): a device killed in the middle of a round leaves the file of its last completed round,
whole, and never a partial one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moetool.io.atomic import atomic_write_file

FORMAT = "moetool-comigs-device-state/1"


@dataclass(frozen=True)
class DeviceState:
    user: str
    run_id: int
    round: int  # the last round whose local training completed
    tensors: dict[str, torch.Tensor]
    counters: dict[str, int]
    reply: dict[str, float] = field(default_factory=dict)  # the round's reply metrics (its tensors: "upload/...")


def state_path(state_dir: Path, user: str) -> Path:
    return state_dir / f"{user}.safetensors"


def save_state(state_dir: Path, state: DeviceState) -> Path:
    """Write ``state`` atomically to ``<state_dir>/<user>.safetensors``; returns the path."""
    path = state_path(state_dir, state.user)
    meta = {
        "format": FORMAT,
        "user": state.user,
        "run_id": str(state.run_id),
        "round": str(state.round),
        "counters": json.dumps(state.counters, sort_keys=True),
        "reply": json.dumps(state.reply, sort_keys=True),
    }
    tensors = {k: v.contiguous() for k, v in state.tensors.items()}
    return atomic_write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_meta(path: Path) -> dict[str, str]:
    """The header of a state file (user, run_id, round, counters) without reading its tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta: dict[str, str] = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a CoMiGS device state (format {meta.get('format')!r}, expected {FORMAT!r})")
    return meta


def load_state(state_dir: Path, user: str) -> DeviceState | None:
    """The saved state of ``user``, or None when there is none."""
    path = state_path(state_dir, user)
    if not path.is_file():
        return None
    meta = read_meta(path)
    if meta["user"] != user:
        raise ValueError(f"{path}: holds user {meta['user']!r}, not {user!r}")
    return DeviceState(
        user=user,
        run_id=int(meta["run_id"]),
        round=int(meta["round"]),
        tensors=load_file(str(path)),
        counters={k: int(v) for k, v in json.loads(meta["counters"]).items()},
        reply=json.loads(meta.get("reply", "{}")),
    )
