"""Atomic output directories: pid-named temp dirs, the sweep of dead writers' leftovers, SIGTERM, the --force swap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from moetool.errors import OutputExistsError, OutputPathError, SourceError
from moetool.io import atomic
from moetool.io.atomic import atomic_dir, exchange, leftover_owner, sweep_leftovers
from moetool.io.checks import check_finished_model_dir, check_output_path, is_finished_model_dir

ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_temp_dir_carries_the_pid_and_vanishes(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out, force=False) as tmp:
        assert tmp.name.startswith(f".out.moetool-tmp-{os.getpid()}-")
        assert leftover_owner(tmp) == ("out", "tmp", os.getpid())
        (tmp / "f").write_text("1")
    assert _names(tmp_path) == ["out"] and (out / "f").read_text() == "1"
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "o2", force=False) as tmp:
        (tmp / "f").write_text("1")
        raise RuntimeError("boom")
    assert _names(tmp_path) == ["out"]


@pytest.mark.parametrize("can_exchange", [True, False])
def test_force_swap_replaces_and_leaves_nothing(tmp_path, monkeypatch, can_exchange):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    calls = []
    real = atomic.exchange

    def spy(a, b):
        calls.append((a, b))
        return real(a, b) if can_exchange else False

    monkeypatch.setattr(atomic, "exchange", spy)
    with pytest.raises(OutputExistsError, match="--force"), atomic_dir(out, force=False):
        pass
    with atomic_dir(out, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert _names(out) == ["new"] and _names(tmp_path) == ["out"] and len(calls) == 1


def test_exchange_swaps_names(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").touch()
    (tmp_path / "b").write_text("file")
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    assert (tmp_path / "a").read_text() == "file" and (tmp_path / "b" / "x").exists()


def test_sweep_removes_dead_temp_dirs_and_restores_the_old_output(tmp_path):
    dead, me = _dead_pid(), os.getpid()
    out = tmp_path / "out"
    (tmp_path / f".out.moetool-tmp-{dead}-abc").mkdir()  # a killed writer's unfinished output
    (tmp_path / f".out.moetool-tmp-{me}-live").mkdir()  # a live writer's: untouched
    (tmp_path / f".other.moetool-tmp-{dead}-abc").mkdir()  # another output's: untouched
    old = tmp_path / f".out.moetool-old-{dead}-x"  # killed between the two renames of a --force swap
    old.mkdir()
    (old / "weights").write_text("complete old output")
    swept = sweep_leftovers(out)
    assert len(swept) == 2
    assert (out / "weights").read_text() == "complete old output"
    assert _names(tmp_path) == [f".other.moetool-tmp-{dead}-abc", f".out.moetool-tmp-{me}-live", "out"]
    # with OUT present, a dead writer's displaced old output is only garbage; so is the pre-0.2 name
    (tmp_path / f".out.moetool-old-{dead}").mkdir()
    sweep_leftovers(out)
    assert (out / "weights").exists() and not (tmp_path / f".out.moetool-old-{dead}").exists()


def test_atomic_write_sweeps_first_and_restored_output_needs_force(tmp_path):
    dead = _dead_pid()
    out = tmp_path / "out"
    old = tmp_path / f".out.moetool-old-{dead}-x"
    old.mkdir()
    (old / "w").write_text("old")
    (tmp_path / f".out.moetool-tmp-{dead}-y").mkdir()
    with pytest.raises(OutputExistsError), atomic_dir(out, force=False):
        pass
    assert _names(tmp_path) == ["out"] and (out / "w").read_text() == "old"


def test_legacy_names_without_pid_are_left_alone(tmp_path):
    (tmp_path / ".out.moetool-tmp-k2j4h5g6").mkdir()
    assert leftover_owner(tmp_path / ".out.moetool-tmp-k2j4h5g6") is None
    assert sweep_leftovers(tmp_path / "out") == []


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    # as from a terminal: a suite run under nohup or as a background job hands its children SIGHUP and SIGINT
    # ignored, which atomic_dir rightly keeps ignoring
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    from moetool.io.atomic import atomic_dir
    with atomic_dir(Path(sys.argv[1]), force=True) as tmp:
        (tmp / "partial").write_bytes(b"x" * 1000)
        print(tmp, flush=True)
        time.sleep(60)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_sigterm_removes_the_temp_dir_like_sigint(tmp_path, sig):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SCRIPT, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    tmp = Path(proc.stdout.readline().strip())
    assert tmp.is_dir()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not tmp.exists(), err
    assert _names(tmp_path) == ["out"] and _names(out) == ["old"]


SWAP_KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from moetool.io import atomic
    atomic.exchange = lambda a, b: False  # the fallback: two renames
    real = os.rename
    def rename(a, b):
        real(a, b)
        if ".moetool-old-" in str(b):
            os.kill(os.getpid(), signal.SIGKILL)  # between the two renames
    atomic.os.rename = rename
    with atomic.atomic_dir(Path(sys.argv[1]), force=True) as tmp:
        (tmp / "new").write_text("new")
    """
)


def test_kill_between_the_two_renames_is_recovered_by_the_next_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    proc = subprocess.run(
        [sys.executable, "-c", SWAP_KILL_SCRIPT, str(out)], check=False, capture_output=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()  # the fallback's window: OUT absent, old output displaced
    assert any(".moetool-old-" in n for n in _names(tmp_path))
    sweep_leftovers(out)
    assert _names(tmp_path) == ["out"] and _names(out) == ["old"]


# --- output path checks ----------------------------------------------------------------------------------------------


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "models" / "expert"
    src.mkdir(parents=True)
    (tmp_path / "afile").write_text("x")
    return [src, tmp_path / "r.yaml"]


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("", "the output path is empty"),
        (".", "name a new directory"),
        ("..", "name a new directory"),
        ("/", "name a new directory"),
        ("sub/..", "name a new directory"),
        ("afile/out", "afile is a file, not a directory"),
        ("afile/deeper/out", "afile is a file, not a directory"),
        ("models/expert", "is an input"),
        ("models/expert/out", "is inside the input"),
        ("models", "contains the input"),
        ("r.yaml", "is an input"),
        (".o.moetool-tmp-1-x", "temporary directory name"),
    ],
)
def test_check_output_path_refuses(inputs, output, expected):
    with pytest.raises(OutputPathError, match=expected):
        check_output_path(output, inputs)


def test_check_output_path_accepts_and_refuses_cwd_parents(inputs, tmp_path):
    assert check_output_path("new/deeper/out", inputs) == tmp_path / "new" / "deeper" / "out"
    with pytest.raises(OutputPathError, match="working directory"):
        check_output_path(str(tmp_path), [])
    with pytest.raises(OutputPathError, match="working directory"):
        check_output_path(str(tmp_path.parent), [])


@pytest.mark.skipif(ROOT_USER, reason="root may write anywhere")
def test_check_output_path_read_only_parent(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(OutputPathError, match="permission denied"):
            check_output_path(ro / "out", [])
    finally:
        ro.chmod(0o755)


def test_read_only_parent_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic.os, "access", lambda p, mode: False)
    with pytest.raises(OutputPathError, match=f"cannot write in {tmp_path}"):
        check_output_path(tmp_path / "out", [])


def test_atomic_dir_refuses_bad_outputs_before_writing(tmp_path):
    (tmp_path / "f").write_text("x")
    for bad in (Path(""), Path(".")):
        with pytest.raises(OutputPathError), atomic_dir(bad, force=True):
            pass
    with (
        pytest.raises(OutputPathError, match="f is a file, not a directory"),
        atomic_dir(tmp_path / "f" / "out", force=True),
    ):
        pass
    assert _names(tmp_path) == ["f"]


# --- finished model directories --------------------------------------------------------------------------------------


def _model(d: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.ones(4, 4)}, str(d / "model.safetensors"))
    return d


def test_finished_model_dirs(tmp_path):
    good = _model(tmp_path / "good")
    assert is_finished_model_dir(good)
    check_finished_model_dir(good)
    tmp = _model(tmp_path / f".out.moetool-tmp-{os.getpid()}-abc")
    assert not is_finished_model_dir(tmp)
    with pytest.raises(SourceError, match="moetool temporary directory"):
        check_finished_model_dir(tmp)
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    with pytest.raises(SourceError, match="no \\*.safetensors weights"):
        check_finished_model_dir(half)
    cut = _model(tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(SourceError, match="past the end"):
        check_finished_model_dir(cut)
    with pytest.raises(SourceError, match="no config.json"):
        check_finished_model_dir(tmp_path)


def test_sigterm_as_the_temp_dir_is_made_leaves_nothing(tmp_path, monkeypatch):
    """The CI failure of stop 26: SIGTERM delivered just after mkdtemp's mkdir, before atomic_dir owned the name.

    The signal goes to another thread that does not block it, as torch's and the hashing thread are in a merge: the
    main thread's signal mask alone does not defer it, since Python runs the handler in the main thread regardless.
    """
    real = tempfile.mkdtemp
    previous_int = signal.getsignal(signal.SIGINT)
    other = threading.Thread(target=time.sleep, args=(5,), daemon=True)

    def mkdtemp(**kw):
        made = real(**kw)
        assert other.ident is not None
        signal.pthread_kill(other.ident, signal.SIGTERM)
        time.sleep(0.3)  # the other thread has run the C handler: Python would raise right here
        return made

    monkeypatch.setattr(atomic, "tempfile", SimpleNamespace(mkdtemp=mkdtemp))
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    other.start()
    try:
        with pytest.raises(atomic.Terminated), atomic_dir(tmp_path / "out", force=False):
            time.sleep(1)  # where the signal lands if it was deferred past the assignment
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert _names(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is previous_int  # every handler put back


def test_signals_in_the_block_end_it_after_as_one_keyboardinterrupt():
    """SIGINTs deferred by the block end it as KeyboardInterrupt once it is over, and only once."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), atomic._signals_blocked():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # both recorded, neither raised here
            reached = True
        assert reached
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        time.sleep(0.2)  # the second SIGINT was dropped with the block, not handed on later
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sigterm_in_a_scratch_dir_removes_it_like_ctrl_c(tmp_path):
    """The work a stage does in a scratch folder between atomic writes (an edit's router recalibration, a LoRA bake)
    ends on SIGTERM as on Ctrl-C, and the folder goes; the handlers in place before are put back."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(atomic.Terminated), atomic.scratch_dir(tmp_path / "out", "prune") as scratch:
            (scratch / "edited").mkdir()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler raises here
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert _names(tmp_path) == []
