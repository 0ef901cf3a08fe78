"""Work run in a Python process of its own, both sides of the protocol: ``python -m MODULE REQUEST.json``, a JSON
object in, a JSON object printed on the last stdout line out.

Two reasons to run a step apart: its library lives in another interpreter (litert-torch's venv,
:mod:`moetool.export.tflite.runner`), or the step leaves memory allocated that only the process's exit gives back
(ExecuTorch's lowering of one chunk, :mod:`moetool.export.executorch.lowering`).

- Caller: :func:`run_worker` writes the request, runs the module and returns the object it printed; a failed worker
  is an :class:`ExportError` with the tail of its stderr.
- Worker: :func:`worker_main` is the module's ``__main__``.

How a run that is stopped leaves nothing behind:

- Its folder. Each worker gets a folder of its own, ``$TMPDIR/moetool-worker-OWNER-XXXXXXXX`` (OWNER: the pid of the
  moetool process that started it), holding its request and serving as the worker's own ``$TMPDIR``, so what its
  libraries put in temporary files goes with it. The folder is removed when the worker ends; the folders of owners
  that are gone (a moetool killed with SIGKILL has no chance to remove its own) are swept by the next worker started
  on the machine (:func:`sweep_work_dirs`). A pid reused by another process only keeps a folder until that one is
  gone too; a live owner's folder is never touched.
- Its process, when moetool is killed: the worker dies with it (Linux's parent-death signal, :func:`die_with_parent`).
  The kernel sends that signal when the *thread* that forked the worker ends, not the process: every worker is
  waited on by the thread that started it (a :class:`~concurrent.futures.ThreadPoolExecutor`'s thread included,
  which never ends while its task runs), so that thread outlives the worker unless the whole process dies.
- Its process, when moetool is interrupted (SIGINT, or SIGTERM raised as one by :mod:`moetool.io.atomic`): workers
  started inside :meth:`WorkerGroup.adopted` belong to that group, and :meth:`WorkerGroup.stop` refuses new ones
  and ends the running ones (SIGTERM to the worker's process group, SIGKILL after a grace);
  :func:`moetool.export.graph.jobs.run_chunks` does so before it lets the interrupt through. A worker run outside a
  group is ended the same way when the thread waiting on it is interrupted. Each worker leads a process group of its
  own, so what it starts goes with it, and a Ctrl-C at the terminal reaches moetool alone, which ends its workers.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from moetool.export.base import ExportError
from moetool.io.atomic import pid_alive

__all__ = [
    "SOURCE_ROOT",
    "WORK_PREFIX",
    "WorkerGroup",
    "die_with_parent",
    "run_worker",
    "sweep_work_dirs",
    "worker_main",
]

# the folder holding this moetool package: a worker in another interpreter imports this same moetool from a
# checkout's src/ (an installed moetool's folder is site-packages, which would shadow the other interpreter's own)
SOURCE_ROOT = Path(__file__).resolve().parents[2]

WORK_PREFIX = "moetool-worker-"
_WORK = re.compile(rf"^{WORK_PREFIX}(?P<pid>\d+)-")
GRACE_S = 3.0  # between SIGTERM and SIGKILL of a stopped worker
_POLL_S = 0.25  # how often a thread waiting on a worker comes back to Python (where signal handlers run)
_PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up in the parent: a child forked from a threaded process must not ``dlopen``."""
    if sys.platform != "linux":
        return None
    try:
        fn: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return fn


def die_with_parent(owner: int | None = None) -> None:
    """In a child between fork and exec: ask the kernel to kill it when the thread that started it ends; with
    ``owner`` (the parent's pid, taken before the fork) a parent already gone by then ends the child at once. A
    no-op where ``prctl`` is not Linux's."""
    prctl = _prctl()
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if owner is not None and os.getppid() != owner:  # the parent died before the signal was asked for
        os._exit(1)


def sweep_work_dirs(root: Path | None = None) -> list[Path]:
    """Remove the worker folders in ``root`` (default: ``$TMPDIR``) whose owner process is gone; returns them."""
    base = Path(root) if root is not None else Path(tempfile.gettempdir())
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    gone = [p for p in entries if (m := _WORK.match(p.name)) is not None and not pid_alive(int(m["pid"]))]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


class WorkerGroup:
    """The workers started by a set of threads, to be stopped together (:func:`run_chunks`'s on an interrupt)."""

    _current = threading.local()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen[str]] = set()
        self._stopped = False

    @classmethod
    def of_this_thread(cls) -> WorkerGroup | None:
        """The group this thread's workers join, if any."""
        group: WorkerGroup | None = getattr(cls._current, "group", None)
        return group

    @contextmanager
    def adopted(self) -> Iterator[None]:
        """Workers this thread starts meanwhile join this group."""
        previous = self.of_this_thread()
        self._current.group = self
        try:
            yield
        finally:
            self._current.group = previous

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        """Start a worker in this group.

        Raises:
            ExportError: the group was stopped (no worker starts after that).
        """
        hook = functools.partial(die_with_parent, os.getpid()) if _prctl() is not None else None
        with self._lock:  # a worker starting while stop() runs is either refused or seen by it
            if self._stopped:
                raise ExportError("the export was interrupted: no more conversions start")
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
                # safe with threads as this hook is: no lock, no dlopen, only the prctl looked up before the fork
                preexec_fn=hook,  # noqa: PLW1509
            )
            self._procs.add(proc)
        return proc

    def forget(self, proc: subprocess.Popen[str]) -> None:
        with self._lock:
            self._procs.discard(proc)

    def stop(self, grace: float = GRACE_S) -> None:
        """Refuse new workers; end the running ones (:func:`_end`). Returns once they have ended."""
        with self._lock:
            self._stopped = True
            procs = list(self._procs)
        _end(procs, grace)


def _end(procs: list[subprocess.Popen[str]], grace: float) -> None:
    """SIGTERM the workers ``procs`` (their process groups), SIGKILL those still there after ``grace`` seconds (at
    once without one); returns once they have ended."""
    for proc in procs:
        _signal_group(proc, signal.SIGTERM if grace > 0 else signal.SIGKILL)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    """``sig`` to the process group ``proc`` leads (what it started goes too), or to ``proc`` itself."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the group is empty: ended already
        return
    except OSError:
        with suppress(OSError):
            proc.send_signal(sig)


def _communicate(proc: subprocess.Popen[str], group: WorkerGroup) -> tuple[str, str]:
    """The worker's stdout and stderr once it has ended; interrupted, it is ended before the interrupt goes on."""
    try:
        while True:
            try:  # with a timeout: the main thread comes back to run a signal handler even if another got the signal
                return proc.communicate(timeout=_POLL_S)
            except subprocess.TimeoutExpired:
                continue
    except BaseException:  # this worker alone: in a chunk's thread, what fails here is no interrupt of the others
        _end([proc], GRACE_S)
        raise
    finally:
        group.forget(proc)


def run_worker(
    module: str, request: dict[str, Any], *, python: str | None = None, what: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run worker ``module`` on ``request`` in ``python`` (default: this interpreter), with ``env`` added to this
    process's environment; returns the result it printed. It joins this thread's :class:`WorkerGroup`, if any.

    Raises:
        ExportError: ``"{what} failed in {python}:"`` and the last lines of the worker's stderr; or the group was
            stopped.
    """
    py = python or sys.executable
    sweep_work_dirs()
    work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-"))
    try:
        path = work / "request.json"
        path.write_text(json.dumps(request))
        full_env = os.environ | (env or {}) | {"TMPDIR": str(work)}
        if SOURCE_ROOT.name == "src":
            full_env["PYTHONPATH"] = str(SOURCE_ROOT)
        group = WorkerGroup.of_this_thread() or WorkerGroup()
        proc = group.start([py, "-m", module, str(path)], full_env)
        stdout, stderr = _communicate(proc, group)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        raise ExportError(f"{what} failed in {py}:\n{tail}")
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return result


def worker_main(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A worker's ``__main__``: the request file named on the command line in, ``handle(request)`` out as JSON on
    the last stdout line (libraries may print before it)."""
    request: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(handle(request)))
