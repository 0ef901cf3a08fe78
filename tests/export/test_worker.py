"""A step run in a Python process of its own: its result comes back, and a failure is an error naming the step,
the interpreter and what the worker said."""

from __future__ import annotations

import sys

import pytest

from moetool.export.base import ExportError
from moetool.export.worker import run_worker


def test_a_worker_result_comes_back(tmp_path):
    """The ExecuTorch lowering's worker module, asked for a chunk of a model that is not there: its own error (the
    missing checkpoint) comes back as the step's error, with the interpreter it ran in."""
    with pytest.raises(ExportError, match="ExecuTorch lowering failed in") as err:
        run_worker(
            "moetool.export.executorch.lowering",
            {"model_dir": str(tmp_path / "absent"), "layers": [0, 1], "first": True, "last": True, "precisions": {},
             "path": str(tmp_path / "p.pte")},
            what="ExecuTorch lowering",
        )  # fmt: skip
    assert sys.executable in str(err.value) and "absent" in str(err.value)
    assert not (tmp_path / "p.pte").exists()


def test_a_worker_that_is_no_module_is_named(tmp_path):
    with pytest.raises(ExportError, match=r"(?s)the step failed in .*No module named moetool\.absent"):
        run_worker("moetool.absent", {}, what="the step")


def test_a_worker_dies_with_the_process_that_started_it(tmp_path):
    """A killed export leaves no orphaned worker: a parent started with run_worker's pre-exec hook is killed with
    SIGKILL (no chance to clean up), and its child goes with it."""
    import os
    import signal
    import subprocess
    import time

    script = (
        "import subprocess, sys\n"
        "from moetool.export.worker import die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=die_with_parent)\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:  # a zombie (dead, not yet reaped by init) counts as gone
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the worker outlived the process that started it")


def test_run_worker_starts_its_worker_with_the_hook(tmp_path, monkeypatch):
    import subprocess

    from moetool.export import worker

    seen = {}

    def fake_run(cmd, **kw):
        seen.update(kw)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"ok": true}\n', stderr="")

    monkeypatch.setattr(worker.subprocess, "run", fake_run)
    assert run_worker("moetool.anything", {}, what="the step") == {"ok": True}
    assert seen["preexec_fn"] is worker.die_with_parent
