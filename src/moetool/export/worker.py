"""Work run in a Python process of its own, both sides of the protocol: ``python -m MODULE REQUEST.json``, a JSON
object in, a JSON object printed on the last stdout line out.

Two reasons to run a step apart: its library lives in another interpreter (litert-torch's venv,
:mod:`moetool.export.tflite.runner`), or the step leaves memory allocated that only the process's exit gives back
(ExecuTorch's lowering of one chunk, :mod:`moetool.export.executorch.lowering`).

- Caller: :func:`run_worker` writes the request, runs the module and returns the object it printed; a failed worker
  is an :class:`ExportError` with the tail of its stderr.
- Worker: :func:`worker_main` is the module's ``__main__``.

A worker dies with the process that started it (Linux's parent-death signal): an export killed while a chunk is
being converted leaves no orphaned worker to run on and write into the temporary folder the next run sweeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetool.export.base import ExportError

__all__ = ["SOURCE_ROOT", "die_with_parent", "run_worker", "worker_main"]

# the folder holding this moetool package: a worker in another interpreter imports this same moetool from a
# checkout's src/ (an installed moetool's folder is site-packages, which would shadow the other interpreter's own)
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def die_with_parent() -> None:
    """In a child between fork and exec: ask the kernel to kill it when the thread that started it ends (a no-op
    where ``prctl`` is not Linux's)."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def run_worker(
    module: str, request: dict[str, Any], *, python: str | None = None, what: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run worker ``module`` on ``request`` in ``python`` (default: this interpreter), with ``env`` added to this
    process's environment; returns the result it printed.

    Raises:
        ExportError: ``"{what} failed in {python}:"`` and the last lines of the worker's stderr.
    """
    py = python or sys.executable
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "request.json"
        path.write_text(json.dumps(request))
        proc = subprocess.run(
            [py, "-m", module, str(path)],
            check=False,
            capture_output=True,
            text=True,
            env=os.environ | (env or {}) | ({"PYTHONPATH": str(SOURCE_ROOT)} if SOURCE_ROOT.name == "src" else {}),
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise ExportError(f"{what} failed in {py}:\n{tail}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def worker_main(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A worker's ``__main__``: the request file named on the command line in, ``handle(request)`` out as JSON on
    the last stdout line (libraries may print before it)."""
    request: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(handle(request)))
