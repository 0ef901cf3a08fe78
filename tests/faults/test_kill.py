"""Killed writes: SIGKILL ``moetool merge``, ``moetool export`` and ``moetool train`` at chosen points.

After any kill, OUT is absent (first write), the complete old output (``--force``, killed before the swap) or the
complete new one (killed after it); the next run sweeps every ``moetool-tmp``/``moetool-old`` leftover of the dead
writer. The chosen points are reached deterministically: the subprocess runs the real CLI with a few functions wrapped
so that, at the named point, it writes a marker and waits to be killed. One more test kills the installed
``moetool`` executable as soon as its temp dir appears, and one sends it SIGTERM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moetool.io.checks import is_finished_model_dir

pytestmark = pytest.mark.slow

MOETOOL = Path(sys.executable).with_name("moetool")

# A fork server: imports moetool, torch and transformers once (and computes nothing, so forking is safe), then forks
# one child per run. Each child is a separate process with its own pid running the real CLI (`moetool ARGS`), with a
# few functions wrapped so that it stops for good at the point named in the request after writing the marker file.
SERVER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    import torch, transformers  # noqa: F401
    import moetool.cli, moetool.methods.mofe.execute, moetool.export.gguf.exporter  # noqa: F401
    from moetool.io import atomic, writer

    def child(req):
        if req.get("threads"):  # the caller's torch thread count: a resumed run must add up as the caller's does
            torch.set_num_threads(req["threads"])
        point, marker = req["point"], Path(req["marker"])
        state = {"swapped": False, "added": 0}

        def hold(name):
            if name == point:
                marker.write_text(name)
                time.sleep(300)

        real_mkdtemp = atomic.tempfile.mkdtemp
        def mkdtemp(*a, **k):
            path = real_mkdtemp(*a, **k)
            if ".moetool-tmp-" in str(k.get("prefix", "")):
                hold("tmp-created")
            return path
        atomic.tempfile.mkdtemp = mkdtemp

        real_add = writer.ShardedWriter.add
        def add(self, name, tensor):
            real_add(self, name, tensor)
            state["added"] += 1
            if state["added"] == 5:
                hold("mid-shard")
        writer.ShardedWriter.add = add

        real_swap = atomic._swap_in
        def swap(tmp, out):
            hold("before-swap")
            garbage = real_swap(tmp, out)
            state["swapped"] = True
            return garbage
        atomic._swap_in = swap

        real_remove = atomic._remove
        def remove(path):
            if state["swapped"]:
                hold("after-swap")
            return real_remove(path)
        atomic._remove = remove

        from moetool.export.gguf import verify
        from moetool.train import checkpoint

        real_compare = verify.compare
        def compare(*a, **k):
            hold("verifying")  # the dequantized copy of the artifact's weights exists now
            return real_compare(*a, **k)
        verify.compare = compare

        real_save = checkpoint.save_checkpoint
        def save(*a, **k):
            real_save(*a, **k)
            hold("checkpointed")
        checkpoint.save_checkpoint = save

        os.chdir(req["cwd"])
        sys.argv = ["moetool", *req["args"]]
        try:
            moetool.cli.main()
        except SystemExit as exc:
            os._exit(exc.code if isinstance(exc.code, int) else 1)
        os._exit(0)

    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "run":
            pid = os.fork()
            if pid == 0:
                sys.stdin.close()
                log = os.open(req["marker"] + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                child(req)
            print(pid, flush=True)
        else:
            _, status = os.waitpid(req["pid"], 0)
            print(os.waitstatus_to_exitcode(status), flush=True)
    """
)


class ForkServer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._read() == "ready"

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line, "the fork server died"
        return line

    def _send(self, req: dict) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, args: list[str], *, point: str, marker: Path, cwd: Path, threads: int = 0) -> int:
        req = {"op": "run", "args": args, "point": point, "marker": str(marker), "cwd": str(cwd), "threads": threads}
        return int(self._send(req))

    def wait(self, pid: int) -> int:
        return int(self._send({"op": "wait", "pid": pid}))

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    s = ForkServer()
    yield s
    s.close()


def _kill_at(
    server: ForkServer, point: str, args: list[str], marker: Path, cwd: Path, timeout: float = 120, threads: int = 0
) -> None:
    """Run ``moetool ARGS`` in a forked child, SIGKILL it once it reaches ``point``."""
    pid = server.run(args, point=point, marker=marker, cwd=cwd, threads=threads)
    deadline = time.monotonic() + timeout
    try:
        while not marker.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"{point}: not reached in {timeout}s")
            try:  # still running? (a finished child is a zombie until waited: check its state)
                state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0]
            except FileNotFoundError:
                state = "Z"
            if state == "Z":
                log = Path(f"{marker}.log").read_text(errors="replace")
                pytest.fail(f"{point}: the run ended (exit {server.wait(pid)}) before the point:\n{log}")
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        assert server.wait(pid) == -signal.SIGKILL
    finally:
        marker.unlink(missing_ok=True)
        Path(f"{marker}.log").unlink(missing_ok=True)


def _recipe(env) -> Path:
    return env.recipe(
        f"""\
name: killed
method: mofe
base_model: {env.models["base"]}
gate_mode: random
experts_per_token: 1
max_shard_size: 40000
experts:
  - {{name: a, source: {env.models["e1"]}}}
  - {{name: b, source: {env.models["e2"]}}}
"""
    )


def _ok(tools, args: list[str]) -> None:
    res = tools.runner.invoke(tools.app, args)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    ("point", "force"),
    [
        ("tmp-created", False),
        ("mid-shard", False),
        ("before-swap", False),
        ("mid-shard", True),
        ("before-swap", True),
        ("after-swap", True),
    ],
)
def test_killed_merge(server, env, tools, point, force):
    r = _recipe(env)
    out = env.outs / "moe"
    args = ["merge", str(r), "-o", str(out)]
    old = None
    if force:
        _ok(tools, args)
        (out / "marker-of-the-old-output").write_text("old")
        old = tools.tree_digest([out])
        args.append("--force")
    inputs = tools.tree_digest([r, *env.models.values()])

    _kill_at(server, point, args, env.root / "marker", env.work)

    if old is None:
        assert not out.exists(), f"killed at {point}: a partial output"
    elif point == "after-swap":
        assert is_finished_model_dir(out) and not (out / "marker-of-the-old-output").exists()
    else:
        assert tools.tree_digest([out]) == old, f"killed at {point}: the old output changed"
    assert tools.leftovers(env.outs), "the kill should leave the dead writer's temp dir (swept next)"
    assert tools.tree_digest([r, *env.models.values()]) == inputs

    _ok(tools, [*args[:4], "--force"])  # the next run: sweeps, then writes
    assert is_finished_model_dir(out) and not (out / "marker-of-the-old-output").exists()
    assert not tools.leftovers(env.root), tools.leftovers(env.root)
    assert sorted(p.name for p in env.outs.iterdir()) == ["moe"]


@pytest.mark.parametrize("point", ["tmp-created", "before-swap", "after-swap"])
def test_killed_export(server, env, tools, point):
    art = env.outs / "art"
    args = ["export", str(env.models["e1"]), "-o", str(art), "--no-verify"]
    _ok(tools, args)
    (art / "marker-of-the-old-output").write_text("old")
    old = tools.tree_digest([art])
    args.append("--force")
    inputs = tools.tree_digest(env.models.values())

    _kill_at(server, point, args, env.root / "marker", env.work)

    if point == "after-swap":
        assert (art / "manifest.json").is_file() and not (art / "marker-of-the-old-output").exists()
    else:
        assert tools.tree_digest([art]) == old, f"killed at {point}: the old output changed"
    assert tools.leftovers(env.outs)
    assert tools.tree_digest(env.models.values()) == inputs

    _ok(tools, args)
    assert (art / "manifest.json").is_file() and not (art / "marker-of-the-old-output").exists()
    assert not tools.leftovers(env.root), tools.leftovers(env.root)


def _wait_for_tmp(parent: Path, proc: subprocess.Popen, timeout: float = 120) -> Path | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = [p for p in parent.iterdir() if ".moetool-tmp-" in p.name]
        if found:
            return found[0]
        time.sleep(0.002)
    return None


@pytest.mark.skipif(not MOETOOL.exists(), reason="the moetool executable is not installed next to python")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_installed_moetool_killed_when_its_temp_dir_appears(env, tools, sig):
    """The real executable, no hooks: kill as soon as the temp dir shows (the run may win the race; the invariants
    hold either way). SIGTERM must remove the temp dir itself."""
    r = _recipe(env)
    out = env.outs / "moe"
    proc = subprocess.Popen(
        [str(MOETOOL), "merge", str(r), "-o", str(out)], cwd=env.work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    tmp = _wait_for_tmp(env.outs, proc)
    if tmp is not None:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    if tmp is None or proc.returncode == 0:  # finished before the signal landed
        assert proc.returncode == 0 and is_finished_model_dir(out), err.decode()
    else:
        assert not out.exists() or is_finished_model_dir(out)  # the signal may land after the swap
        if sig == signal.SIGTERM:
            assert not tools.leftovers(env.root), f"SIGTERM left {tools.leftovers(env.root)}"
            assert b"Traceback" not in err, err.decode()
    _ok(tools, ["merge", str(r), "-o", str(out), "--force"])
    assert not tools.leftovers(env.root)
    shutil.rmtree(out)


def test_killed_export_during_verification_leaves_nothing_in_tmpdir(server, env, tools):
    """The dequantized copy of the weights that GGUF verification compares with lives in the output's temporary
    folder: a SIGKILL there leaves nothing in $TMPDIR, and the next run sweeps the rest."""
    import tempfile

    art = env.outs / "art"
    args = ["export", str(env.models["e1"]), "-o", str(art), "--quant", "q8_0"]
    tmpdir = Path(tempfile.gettempdir())
    before = {p.name for p in tmpdir.glob("moetool-parity-*")}
    _kill_at(server, "verifying", args, env.root / "marker", env.work)
    assert {p.name for p in tmpdir.glob("moetool-parity-*")} == before
    assert not art.exists() and tools.leftovers(env.outs)
    _ok(tools, args)
    assert (art / "manifest.json").is_file() and not tools.leftovers(env.root)


def test_killed_training_resumes_to_the_uninterrupted_model(server, env, tools):
    """SIGKILL after a checkpoint: no output is written, and the same command resumes from the checkpoint to the
    model an uninterrupted run writes, tensor for tensor."""
    from tuning_fixtures import read_all_tensors, write_tuning_recipe

    models = {"base": env.models["base"], "e1": env.models["e1"], "e2": env.models["e2"], "e3": env.models["e2"]}
    recipe = write_tuning_recipe(env.work, models, steps=4)
    _ok(tools, ["merge", str(recipe), "-o", str(env.outs / "moe")])
    straight = env.outs / "straight"
    _ok(tools, ["train", str(recipe), "--model", str(env.outs / "moe"), "-o", str(straight)])
    tuned = env.outs / "tuned"
    args = ["train", str(recipe), "--model", str(env.outs / "moe"), "-o", str(tuned)]
    import torch

    # the same thread count as this process (another test module may have set 1): float sums then add up alike
    _kill_at(server, "checkpointed", args, env.root / "marker", env.work, threads=torch.get_num_threads())
    assert not tuned.exists()
    res = tools.runner.invoke(tools.app, args)
    assert res.exit_code == 0 and "resuming from step" in res.output, res.output
    a, b = read_all_tensors(straight), read_all_tensors(tuned)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


@pytest.mark.skipif(not MOETOOL.exists(), reason="the moetool executable is not installed next to python")
def test_sigterm_during_prune_recalibration_exits_130_and_leaves_nothing(env, tools):
    """``experts prune --tune-steps`` recalibrates in a scratch folder between two atomic writes; SIGTERM there ends
    the run as Ctrl-C does (exit 130, the scratch folder removed, the MoE untouched), as ``experts add`` does. It used
    to die of the signal (-15) and leave ``.OUT.moetool-tmp-PID-prune-…`` for the next run to sweep."""
    r = _recipe(env)
    moe = env.outs / "moe"
    _ok(tools, ["merge", str(r), "-o", str(moe)])
    text = env.work / "calib.txt"
    text.write_text("def main():\n    return os.path.join('a', 'b')\n\n" * 200, encoding="utf-8")
    before = tools.tree_digest([moe, text])
    out = env.outs / "pruned"
    args = ["experts", "prune", str(moe), "-o", str(out), "--keep", "1", "--data", f"calib={text}"]
    proc = subprocess.Popen(
        [str(MOETOOL), *args, "--tune-steps", "100000"], cwd=env.work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    seen = ""
    while "parameters:" not in seen:  # the tuning loop is about to start its steps
        line = proc.stderr.readline().decode(errors="replace")
        assert line, f"the run ended before recalibrating:\n{seen}"
        seen += line
    assert [p for p in env.outs.iterdir() if ".moetool-tmp-" in p.name and "-prune-" in p.name]
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, seen + err.decode(errors="replace"))
    assert not out.exists() and not tools.leftovers(env.root), tools.leftovers(env.root)
    assert tools.tree_digest([moe, text]) == before
    assert b"Traceback" not in err
