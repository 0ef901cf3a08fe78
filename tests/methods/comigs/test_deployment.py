"""CoMiGS on Flower's deployment engine, for real: a SuperLink and one SuperNode per user as separate processes on
127.0.0.1 (TLS from a generated CA, SuperNode authentication), driven by ``flwr run``.

One deployment serves both tests (starting it costs ~20 s on 2 cores; each ``flwr run`` round starts a ClientApp
process per device, which imports torch). Every subprocess has a timeout and the fixture kills every process group
it started, whatever happens.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
import torch
from comigs_fixtures import two_user_recipe

from moetool.methods.comigs.deploy import HOST, LocalDeployment
from moetool.methods.comigs.device_state import DeviceState, load_state, read_meta, save_state, state_path

ROOT = Path(__file__).resolve().parents[3]
FLWR_BIN = ROOT / ".venv-flwr" / "bin"
APP = ROOT / "examples" / "comigs-flower"
NEEDS_FLWR = pytest.mark.skipif(
    not (FLWR_BIN / "flower-superlink").is_file(),
    reason="needs Flower's venv .venv-flwr: create it with `bash scripts/setup_comigs.sh` "
    "(or `bash scripts/setup.sh --comigs`)",
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("comigs-deploy")
    recipe = two_user_recipe(root, name="dep")
    d = LocalDeployment(root / "work", 2, FLWR_BIN)
    with d:
        yield d, recipe
        groups = {p.pid for p in d._procs.values()}
    assert not _alive(groups)  # SuperExecs, ServerApps and ClientApps included


def _alive(groups: set[int]) -> list[int]:
    """Processes (not zombies) still in these process groups."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            alive.append(int(stat.parent.name))
    return alive


@pytest.fixture(scope="module")
def simulated(deployment, tmp_path_factory) -> dict:
    """The report of the same 2-round run in Flower's simulation engine (test_flower.py ties that engine to the
    in-process runner)."""
    _, recipe_path = deployment
    code = "import sys; from pathlib import Path; from moetool.methods.comigs.flower import simulate; "
    code += "simulate(Path(sys.argv[1]), Path(sys.argv[2]), rounds=2)"
    out = tmp_path_factory.mktemp("simulated") / "out"
    argv = [str(FLWR_BIN / "python"), "-c", code, str(recipe_path), str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "comigs-report.json").read_text())


def _same_run(report: dict, ref: dict) -> float:
    """Asserts that two reports are one run (rounds, users, uploads); returns the largest relative gap of the
    per-round train CEs and the test perplexities."""
    assert report["rounds"] == ref["rounds"] == 2 and sorted(report["users"]) == sorted(ref["users"]) == ["a", "b"]
    assert report["upload_bytes_per_round"] == ref["upload_bytes_per_round"]
    gaps = []
    for mine, theirs in zip(report["history"], ref["history"], strict=True):
        assert mine["round"] == theirs["round"] and sorted(mine["train_ce"]) == sorted(theirs["train_ce"]) == ["0", "1"]
        gaps += [abs(mine["train_ce"][i] - theirs["train_ce"][i]) / theirs["train_ce"][i] for i in ("0", "1")]
    for user, r in ref["users"].items():
        gaps.append(abs(report["users"][user]["test_ppl"] - r["test_ppl"]) / r["test_ppl"])
    return max(gaps)


def _meta(d: LocalDeployment, node: int, user: str) -> dict[str, str] | None:
    path = state_path(d.state_dir(node), user)
    return read_meta(path) if path.is_file() else None


@pytest.mark.slow
@NEEDS_FLWR
def test_tls_and_node_authentication(deployment):
    d, _ = deployment
    ca = d.workdir / "certs" / "ca.crt"
    # the SuperLink speaks TLS only, with a certificate that our CA signed for 127.0.0.1
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection((HOST, d.port), timeout=10) as raw, ctx.wrap_socket(raw, server_hostname=HOST) as s:
        assert s.version() in ("TLSv1.2", "TLSv1.3")
    with pytest.raises(ssl.SSLCertVerificationError), socket.create_connection((HOST, d.port), timeout=10) as raw:
        ssl.create_default_context().wrap_socket(raw, server_hostname=HOST)  # system CAs do not know it
    # each SuperNode's own Runtime API (for its SuperExec and ClientApps) is HTTPS too
    assert all("Uvicorn running on https://" in d.log(f"supernode{i}").read_text() for i in (0, 1))
    # both SuperNodes are in with the keys registered for them; a SuperNode with a key nobody registered is turned away
    nodes = {int(n["node-id"]): n["status"] for n in d._nodes()}
    assert sorted(nodes) == sorted(d.node_ids) and set(nodes.values()) == {"online"}
    d.new_key("intruder")
    assert d.start_node(0, key="intruder").wait(timeout=120) != 0
    assert "Failed to activate SuperNode" in d.log("intruder").read_text(errors="replace")
    assert sorted(int(n["node-id"]) for n in d._nodes()) == sorted(d.node_ids)


@pytest.mark.slow
@NEEDS_FLWR
def test_deployment_matches_simulation(deployment, simulated, tmp_path):
    d, recipe_path = deployment
    out = tmp_path / "deployed"
    t0 = time.monotonic()
    result = d.run(APP, {"recipe": str(recipe_path), "output": str(out), "rounds": 2}, timeout=420)
    assert result.ok and (out / "comigs-report.json").is_file(), (result.status, result.log[-3000:])
    seconds = time.monotonic() - t0
    report = json.loads((out / "comigs-report.json").read_text())
    ref = simulated
    # round by round (each user's train CE) and at the end (test perplexity); measured: equal to the last bit
    gap = _same_run(report, ref)
    assert gap <= 1e-6, gap
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["a", "b"]
    # every device wrote its state after each completed round: both files hold round 2 of one run
    metas = [_meta(d, 0, "a"), _meta(d, 1, "b")]
    assert all(m is not None and m["round"] == "2" for m in metas) and metas[0]["run_id"] == metas[1]["run_id"]
    print(f"deployment run: {seconds:.1f} s; max relative gap to the simulation: {gap:.2e}")


def _wait_for(what: str, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


@pytest.mark.slow
@NEEDS_FLWR
def test_supernode_killed_mid_round(deployment, tmp_path):
    """SIGKILL one SuperNode (with its ClientApp) after it received round 2: the run fails naming that device and
    round, and its state file is still round 1's, byte for byte; the other device's file holds only whole rounds."""
    d, recipe_path = deployment
    log1 = d.log("supernode1")
    offset = log1.stat().st_size
    old = _meta(d, 1, "b")
    config = {"recipe": str(recipe_path), "output": str(tmp_path / "o"), "rounds": 3, "round-timeout": 45.0}
    proc = d.submit(APP, config, log_name="flwr-run-kill")

    def in_round_2() -> bool:  # the SuperNode logs "[RUN <id>, ROUND 2]" when it receives the round's message
        return "ROUND 2]" in log1.read_bytes()[offset:].decode(errors="replace")

    _wait_for("SuperNode 1 receives round 2", in_round_2, 240)
    meta = _meta(d, 1, "b")
    assert meta is not None and meta["round"] == "1" and (old is None or meta["run_id"] != old["run_id"])
    path = state_path(d.state_dir(1), "b")
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    d.kill_node(1)
    result = d.finish(proc, "flwr-run-kill", timeout=240)
    assert result.status == "finished:failed", result.status
    assert re.search(rf"round 2: no reply from SuperNode {d.node_ids[1]} \(user b\)", result.log), result.log[-3000:]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before and _meta(d, 1, "b") == meta
    assert not list(path.parent.glob(".*tmp*"))  # no half-written file left beside it
    other = _meta(d, 0, "a")
    assert other is not None and other["run_id"] == meta["run_id"] and other["round"] in ("1", "2")
    assert not (tmp_path / "o" / "comigs-report.json").exists()


@pytest.mark.slow
@NEEDS_FLWR
def test_supernode_killed_and_restarted_with_wait(deployment, simulated, tmp_path):
    """on-missing="wait": SIGKILL SuperNode 1 after it received round 2, restart it with its key and state directory
    once the SuperLink has marked it offline; the server sends round 2 again, the device resumes from its round-1
    file, and the run equals the simulation's."""
    d, recipe_path = deployment
    if "supernode1" not in d._procs:  # the previous test left it dead
        d.restart_node(1)
    log1 = d.log("supernode1")
    offset = log1.stat().st_size
    config = {"recipe": str(recipe_path), "output": str(tmp_path / "o"), "rounds": 2}
    proc = d.submit(APP, config | {"round-timeout": 30.0, "on-missing": "wait"}, log_name="flwr-run-wait")
    _wait_for("SuperNode 1 receives round 2", lambda: "ROUND 2]" in log1.read_bytes()[offset:].decode("latin-1"), 240)
    d.kill_node(1)
    d.restart_node(1)
    result = d.finish(proc, "flwr-run-wait", timeout=300)
    assert result.ok, (result.status, result.log[-3000:])
    assert "sending it again" in result.log
    report = json.loads((tmp_path / "o" / "comigs-report.json").read_text())
    assert "dropped" not in report and _same_run(report, simulated) <= 1e-6


# --- the device's state file, in the main venv (no Flower needed) ------------------------------------------------


def _state(round_: int, value: float) -> DeviceState:
    return DeviceState("u", run_id=7, round=round_, tensors={"param/x": torch.full((3,), value)}, counters={"it": 3})


def test_state_file_round_trip_and_atomic_replace(tmp_path, monkeypatch):
    save_state(tmp_path, _state(1, 1.0))
    got = load_state(tmp_path, "u")
    assert got is not None and (got.run_id, got.round, got.counters) == (7, 1, {"it": 3})
    assert torch.equal(got.tensors["param/x"], torch.ones(3))
    before = state_path(tmp_path, "u").read_bytes()

    # a writer that dies half-way (here: after writing part of the temporary file) leaves the old file as it was
    import moetool.methods.comigs.device_state as ds

    def dying_save(tensors, path, metadata):
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ds, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_state(tmp_path, _state(2, 2.0))
    assert state_path(tmp_path, "u").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u.safetensors"]  # no temporary file left either
    assert load_state(tmp_path, "u").round == 1  # type: ignore[union-attr]


def test_state_file_refuses_another_users_or_format(tmp_path):
    save_state(tmp_path, _state(1, 1.0))
    state_path(tmp_path, "u").rename(state_path(tmp_path, "v"))
    with pytest.raises(ValueError, match="holds user 'u', not 'v'"):
        load_state(tmp_path, "v")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(state_path(tmp_path, "w")))
    with pytest.raises(ValueError, match="not a CoMiGS device state"):
        load_state(tmp_path, "w")
    assert load_state(tmp_path, "nobody") is None


@NEEDS_FLWR
def test_missing_device_policies(tmp_path):
    """The real ServerApp main and ClientApps, wired by a grid that loses user b from round 2 on (deployment_check.py):
    "fail" names the round, node and user; "drop" finishes without b; b's state file stays at round 1 either way.
    "wait" sends round 2 again to b, back with an empty memory, and ends where an uninterrupted run does."""
    recipe = two_user_recipe(tmp_path, name="lossy")
    proc = subprocess.run(
        [str(FLWR_BIN / "python"), str(Path(__file__).with_name("deployment_check.py")), str(recipe), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        check=False,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    fail, drop, wait, late, uninterrupted = json.loads(lines[-1].removeprefix("RESULT "))
    assert fail["error"].startswith("round 2: no reply from SuperNode 101 (user b)") and "on-missing" in fail["error"]
    assert fail["rounds_on_disk"] == {"a": 2, "b": 1}
    assert drop["dropped"] == {"b": 2} and drop["users"] == ["a"]
    assert drop["history_users"] == [["0", "1"], ["0"], ["0"]]  # partition ids that trained in each round (JSON keys)
    assert drop["rounds_on_disk"] == {"a": 3, "b": 1}
    # "wait": b comes back as a fresh process, resumes from its round-1 file, and the run is the uninterrupted one
    assert "error" not in wait and wait["dropped"] is None and wait["rounds_on_disk"] == {"a": 3, "b": 3}
    assert wait["history"] == uninterrupted["history"] and wait["test_ppl"] == uninterrupted["test_ppl"]
    # b dies after writing round 2, before replying, and then gets round 2 twice: it answers from its saved reply
    # both times (from its state file), never training a round twice
    assert late["history"] == uninterrupted["history"] and late["test_ppl"] == uninterrupted["test_ppl"]
    assert late["rounds_on_disk"] == {"a": 3, "b": 3}
