"""Chunks converted several at a time: the results come back in order, the conversions really overlap, a failure
stops what has not started, an interrupt ends what runs, and how many run at once follows --jobs, the cores and the
memory available."""

from __future__ import annotations

import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from worker_fixtures import exists, fake_python

from moetool.export.base import ExportError, ExportRequest
from moetool.export.graph import jobs
from moetool.export.worker import run_worker
from moetool.quant.plan import QuantSpec


def _req(**options: object) -> ExportRequest:
    return ExportRequest(model_dir=Path("m"), output=Path("o"), quant=QuantSpec(), options=dict(options))


def test_results_come_back_in_order_from_conversions_that_overlap():
    # two conversions that each wait for the other: they only finish if both run at once
    both = threading.Barrier(2, timeout=10)

    def convert(i: int, item: str) -> str:
        if i < 2:
            both.wait()
        time.sleep(0.01 * (5 - i))  # later items finish first
        return item.upper()

    assert jobs.run_chunks(list("abcde"), convert, 2) == list("ABCDE")


def test_one_at_a_time_runs_in_order_in_this_thread():
    seen: list[tuple[int, str]] = []

    def convert(i: int, item: str) -> int:
        seen.append((i, threading.current_thread().name))
        return i * 10

    assert jobs.run_chunks(["x", "y", "z"], convert, 1) == [0, 10, 20]
    assert [i for i, _ in seen] == [0, 1, 2]
    assert {name for _, name in seen} == {threading.current_thread().name}


def test_a_failure_is_raised_and_nothing_starts_after_it():
    started: list[int] = []
    lock = threading.Lock()

    def convert(i: int, item: int) -> int:
        with lock:
            started.append(i)
        if i == 1:
            raise ExportError("chunk 1 failed")
        time.sleep(0.2)  # chunk 0 is still running when chunk 1 fails
        return item

    with pytest.raises(ExportError, match="chunk 1 failed"):
        jobs.run_chunks(list(range(8)), convert, 2)
    assert sorted(started) == [0, 1]  # chunk 0 ran to its end; none of 2..7 began


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test, whatever the run inherited: a shell starts a background job with
    SIGINT ignored, and then the interrupt would never come."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("python_sigint")
@pytest.mark.parametrize("at_once", [2, 1])
def test_an_interrupt_ends_the_running_conversions_and_starts_no_queued_one(tmp_path, monkeypatch, at_once):
    """Ctrl-C (SIGTERM is raised as it) while two (one) of four chunks convert: their workers are ended, no queued
    chunk starts, the interrupt comes through within seconds and no worker folder is left. Two at once used to wait
    for all the conversions to run to their end."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    pids = tmp_path / "pids"
    python = fake_python(tmp_path / "python", f"echo $$ >> {pids}\nexec sleep 20\n")

    def started() -> list[int]:
        return [int(line) for line in pids.read_text().split()] if pids.exists() else []

    def interrupt(main: int) -> None:
        while len(started()) < at_once:
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, args=(threading.main_thread().ident,), daemon=True).start()
    begun = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        jobs.run_chunks(range(4), lambda i, _: run_worker("chunk", {}, python=python, what=f"chunk {i}"), at_once)
    assert time.monotonic() - begun < 10
    time.sleep(0.3)  # time enough for a queued chunk to start, were one let through
    assert len(started()) == at_once and not [p for p in started() if exists(p)]
    assert not list(temp.iterdir())


def test_jobs_given_are_kept_within_the_chunks(monkeypatch):
    monkeypatch.setattr(jobs, "cores", lambda: 2)
    assert jobs.planned_jobs(_req(jobs=3), 8, per_job=10, available=1) == 3  # given: the budget check judges it
    assert jobs.planned_jobs(_req(jobs=3), 2, per_job=10, available=100) == 2
    with pytest.raises(ExportError, match="--jobs 0"):
        jobs.planned_jobs(_req(jobs=0), 8, per_job=10, available=100)


@pytest.mark.parametrize(
    ("cores", "chunks", "available", "expected"),
    [
        (2, 24, 100, 2),  # the cores
        (16, 24, 35, 3),  # the memory: three conversions of 10 fit in 35
        (16, 2, 100, 2),  # the chunks
        (4, 24, 5, 1),  # not even one fits: one, which the memory check then refuses
        (3, 24, None, 3),  # memory unknown: the cores
    ],
)
def test_by_default_as_many_as_the_cores_and_the_memory_allow(monkeypatch, cores, chunks, available, expected):
    monkeypatch.setattr(jobs, "cores", lambda: cores)
    assert jobs.planned_jobs(_req(), chunks, per_job=10, available=available) == expected


def test_each_process_gets_its_share_of_the_cores_and_a_users_setting_wins(monkeypatch):
    monkeypatch.setattr(jobs, "cores", lambda: 8)
    for var in jobs.THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    assert jobs.worker_env(1) == {}
    assert jobs.worker_env(2) == dict.fromkeys(jobs.THREAD_VARS, "4")
    assert jobs.worker_env(16) == dict.fromkeys(jobs.THREAD_VARS, "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in jobs.worker_env(2)
