"""A chunked export converting two chunks at once (``--jobs 2``), signalled while its chunk workers run.

SIGTERM: the run ends within seconds (exit 130, as Ctrl-C), its workers are ended with it, no output and no
temporary folder is left, in the output's folder or in ``$TMPDIR``. It used to let the conversions run to their end
(and start the queued ones) before exiting. SIGKILL: the workers die with the run, and the folders it had no chance
to remove from ``$TMPDIR`` are swept by the next worker started; they used to stay there for good.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from moetool.export.base import ExportError
from moetool.export.worker import run_worker

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]

pytest.importorskip("executorch")

LOWERING = "moetool.export.executorch.lowering"
CLI = "import sys; from moetool.cli import main; sys.argv[0] = 'moetool'; main()"


def _children(pid: int) -> list[int]:
    """The live chunk workers whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z" and LOWERING.encode() in cmdline:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _left_in(tmpdir: Path) -> list[str]:
    """What the run left in its ``$TMPDIR``: anything but torch's compile cache, which is meant to stay."""
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))


def _export_until_workers_run(model: Path, out: Path, tmpdir: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start ``moetool export --target executorch --chunk-layers 1 --jobs 2``; return it and its chunk workers once
    the first one runs."""
    args = ["export", str(model), "--target", "executorch", "--chunk-layers", "1", "--jobs", "2", "-o", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI, *args, "--no-verify"],
        env=os.environ | {"TMPDIR": str(tmpdir)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 300
    while not (workers := _children(proc.pid)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            err = proc.communicate()[1].decode(errors="replace")
            pytest.fail(f"no chunk worker started (exit {proc.returncode}):\n{err}")
        time.sleep(0.05)
    time.sleep(0.5)  # the second chunk's worker starts with the first
    return proc, sorted(set(workers) | set(_children(proc.pid)))


def _gone_soon(pids: list[int], seconds: float = 5) -> list[int]:
    """The pids still running after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in alive:  # do not leave them to the next test
        os.kill(p, signal.SIGKILL)
    return alive


@pytest.fixture
def model(tiny_models) -> Path:
    return tiny_models("llama")["base"]  # two decoder layers: two chunks at --chunk-layers 1


def test_sigterm_stops_the_chunk_workers_and_leaves_nothing(model, tmp_path):
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    out = tmp_path / "outs" / "et"
    proc, workers = _export_until_workers_run(model, out, tmpdir)
    assert workers
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        _gone_soon(workers, 0)
        pytest.fail("the export did not end within 20 s of SIGTERM")
    took = time.monotonic() - signalled
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err, err.decode()
    # most of it is the interpreter's own exit with torch and ExecuTorch loaded (about 4 s on a busy machine)
    assert took < 15, f"the export took {took:.1f} s to end after SIGTERM"
    assert not _gone_soon(workers, 0), "a chunk worker outlived the export"
    assert not out.exists() and not list(out.parent.iterdir()), list(out.parent.iterdir())
    assert not _left_in(tmpdir), _left_in(tmpdir)


def test_sigkill_takes_the_chunk_workers_and_the_next_worker_sweeps_their_folders(model, tmp_path, monkeypatch):
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    out = tmp_path / "outs" / "et"
    proc, workers = _export_until_workers_run(model, out, tmpdir)
    assert workers
    proc.kill()
    proc.wait()
    assert not _gone_soon(workers), "a chunk worker outlived the export killed with SIGKILL"
    assert not out.exists()

    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    with pytest.raises(ExportError, match="No module named moetool.absent"):  # the next worker, whatever it is
        run_worker("moetool.absent", {}, what="the next step")
    assert not _left_in(tmpdir), _left_in(tmpdir)
