"""How many chunks a chunked graph export (Core ML, ExecuTorch, TFLite) converts at once, and running them.

Each chunk is converted in a process of its own (:mod:`moetool.export.worker`), and most of a conversion is
single-threaded Python (``torch.export``, the lowering and serialising passes), so one conversion leaves the other
cores idle: converting ``jobs`` chunks at once, each process given its share of the cores' threads, divides the wall
time by up to ``jobs``. Each process holds its own chunk, so the memory estimate counts ``jobs`` of them, and the
default is as many as the cores and the memory available allow (``--jobs`` sets it).

An interrupted run (Ctrl-C, or SIGTERM, which :mod:`moetool.io.atomic` raises as one inside the output's write) stops
at once: no queued chunk starts, the running conversions' processes are ended (:class:`WorkerGroup`: SIGTERM, SIGKILL
after a grace) and their threads waited for, and only then does the interrupt go on to remove the output's temporary
folder, so nothing writes into it after that. The main thread waits in short steps: a signal handler only runs in
the main thread, between two Python steps.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, TypeVar, cast

from moetool.export.graph.chunk import count_option
from moetool.export.worker import GRACE_S, WorkerGroup

if TYPE_CHECKING:
    from moetool.export.base import ExportRequest

__all__ = ["THREAD_VARS", "cores", "given_jobs", "planned_jobs", "run_chunks", "worker_env"]

T = TypeVar("T")
R = TypeVar("R")

# the sizes of torch's (OpenMP's) and the BLAS libraries' thread pools, read when each process starts
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_POLL_S = 0.25  # how long the main thread waits on the conversions before coming back to run a signal handler


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def given_jobs(req: ExportRequest) -> int | None:
    """``--jobs`` (None: not given).

    Raises:
        ExportError: below 1.
    """
    return count_option(req, "jobs", "--jobs", "at least one chunk is converted at a time")


def planned_jobs(req: ExportRequest, chunks: int, per_job: int, available: int | None) -> int:
    """Chunks converted at once: ``--jobs`` (at most ``chunks``), else as many as the cores, the ``chunks`` and the
    ``available`` memory allow, each conversion holding ``per_job`` bytes (at least one: a single conversion that
    does not fit is the memory check's to refuse)."""
    given = given_jobs(req)
    if given is not None:
        return max(1, min(given, chunks))
    fit = cores() if available is None else available // max(1, per_job)
    return max(1, min(cores(), chunks, fit))


def worker_env(jobs: int) -> dict[str, str]:
    """The thread settings for each of ``jobs`` conversion processes: the cores shared out between them, so they do
    not oversubscribe the machine; a setting of the user's own wins (empty: nothing to set)."""
    if jobs <= 1:
        return {}
    share = str(max(1, cores() // jobs))
    return {v: share for v in THREAD_VARS if v not in os.environ}


def run_chunks(items: Sequence[T], convert: Callable[[int, T], R], jobs: int) -> list[R]:
    """``convert(index, item)`` for every item, ``jobs`` at a time, in threads (each ``convert`` waits on a process
    of its own, :func:`moetool.export.worker.run_worker`); the results in the items' order. The first failure is
    raised once the conversions already running have ended, and none is started after it. An interrupt
    (``KeyboardInterrupt``) ends the running conversions' processes, starts none, and is raised once they are gone."""
    if jobs <= 1:
        return [convert(i, item) for i, item in enumerate(items)]
    failed = threading.Event()
    group = WorkerGroup()

    def guarded(i: int, item: T) -> R | None:
        if failed.is_set():  # a conversion failed: what has not started yet never does
            return None
        try:
            with group.adopted():
                return convert(i, item)
        except BaseException:
            failed.set()
            raise

    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="moetool-chunk")
    futures: list[Future[R | None]] = []
    try:
        futures = [pool.submit(guarded, i, item) for i, item in enumerate(items)]
        while wait(futures, timeout=_POLL_S).not_done:  # after a failure, what was queued returns at once
            pass
    except BaseException:  # an interrupt: what runs is ended, nothing more starts
        failed.set()
        _stop(group, futures)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # every future is done by now
    if failed.is_set():
        raise next(e for f in futures if not f.cancelled() and (e := f.exception()) is not None)
    return [cast("R", f.result()) for f in futures]


def _stop(group: WorkerGroup, futures: list[Future[R | None]]) -> None:
    """End the group's workers and wait for the threads waiting on them; a second interrupt meanwhile skips the
    grace (SIGKILL at once) but still waits, so no conversion outlives the run."""
    grace = GRACE_S
    for f in futures:
        f.cancel()
    while True:
        try:
            group.stop(grace)
            wait(futures)
            return
        except KeyboardInterrupt:
            grace = 0.0
