"""Launching ``tests/train/launch_worker.py`` as two gloo processes under ``accelerate launch`` on loopback, and
reading the router weights of the tuned models it writes (shared by the DDP and FSDP tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "accelerate"
BIN = Path(sys.executable).parent
WORKER = ROOT / "tests" / "train" / "launch_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(config: str, *args: str) -> str:
    """``launch_worker.py ARGS`` under ``accelerate launch --config_file examples/accelerate/CONFIG``; returns the
    processes' output (the test fails with its tail when the launch does)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / config), "--main_process_port"]
    cmd += [str(free_port()), str(WORKER), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def routers(path: Path) -> dict[str, torch.Tensor]:
    """The router weights of a model folder, by checkpoint name."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys() if k.endswith(".gate.weight")}  # noqa: SIM118
    assert out, f"no router weights in {path}"
    return out


def max_router_diff(a: Path, b: Path) -> float:
    ra, rb = routers(a), routers(b)
    assert set(ra) == set(rb)
    return max(float((ra[k] - rb[k]).abs().max()) for k in ra)
