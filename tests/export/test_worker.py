"""A step run in a Python process of its own: its result comes back, and a failure is an error naming the step,
the interpreter and what the worker said."""

from __future__ import annotations

import sys
from pathlib import Path

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


# a stand-in worker reporting how it was started: its parent-death signal, whether it leads a process group, its $TMPDIR
REPORT = """\
import ctypes, json, os
sig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
print(json.dumps({"pdeathsig": sig.value, "leader": os.getpgid(0) == os.getpid(), "tmp": os.environ.get("TMPDIR", "")}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's parent-death signal")
@pytest.mark.parametrize("jobs", [1, 2])
def test_every_worker_dies_with_its_parent_and_has_a_folder_of_its_own(tmp_path, monkeypatch, jobs):
    """Started from the main thread or from the chunk runner's threads, each worker is to be killed with the
    thread that started it, leads its own process group (ended as one), and has for $TMPDIR a folder named after
    this process that is gone once the worker has ended."""
    import os
    import tempfile

    from worker_fixtures import fake_python

    from moetool.export.graph.jobs import run_chunks

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    (tmp_path / "report.py").write_text(REPORT)
    python = fake_python(tmp_path / "python", f"exec {sys.executable} {tmp_path / 'report.py'}\n")
    got = run_chunks(range(2), lambda i, _: run_worker("w", {}, python=python, what="the step"), jobs)
    for report in got:
        assert report["pdeathsig"] == 9 and report["leader"]
        assert Path(report["tmp"]).parent == temp and Path(report["tmp"]).name.startswith(
            f"moetool-worker-{os.getpid()}-"
        )
    assert not list(temp.iterdir())


def test_the_folders_of_workers_whose_owner_is_gone_are_swept(tmp_path, monkeypatch):
    """A moetool killed with SIGKILL cannot remove its workers' folders; the next worker started removes them, and
    leaves those of a live owner and anything not a worker's."""
    import os
    import subprocess
    import tempfile

    from worker_fixtures import fake_python

    dead = subprocess.Popen(["true"])
    dead.wait()
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    for name in (f"moetool-worker-{dead.pid}-x", f"moetool-worker-{os.getpid()}-y", "someone-elses"):
        (temp / name).mkdir()
        (temp / name / "request.json").write_text("{}")
    assert run_worker("w", {}, python=fake_python(tmp_path / "python", "echo '{}'\n"), what="the step") == {}
    assert sorted(p.name for p in temp.iterdir()) == [f"moetool-worker-{os.getpid()}-y", "someone-elses"]
