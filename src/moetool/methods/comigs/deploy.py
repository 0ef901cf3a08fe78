"""CoMiGS on Flower's deployment engine, on one machine: a SuperLink and one SuperNode per user as separate
processes on 127.0.0.1, driven by ``flwr run``, with TLS (a fresh local CA) and SuperNode authentication.

Only the standard library is imported here, so the launcher works from any Python: every Flower command, and the
certificate generation (``cryptography``, a flwr dependency), runs in the Flower venv (``bin``, .venv-flwr/bin). Every
process gets its own session so that it can be stopped with everything it spawned (Flower's SuperExec and the
ServerApp/ClientApp processes), and every wait has a deadline. Used by examples/comigs-flower/launch.py and
tests/methods/comigs/test_deployment.py; docs/comigs.md shows the same commands for real machines.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO, TypeVar

if TYPE_CHECKING:  # a typing alias only: the launcher imports nothing outside the standard library
    from moetool.io.jsontypes import JsonObject, JsonValue

T = TypeVar("T")
ConfigValue = str | int | float | bool  # a value of Flower's run config or node config

HOST = "127.0.0.1"
CONNECTION = "comigs-local"  # the SuperLink connection's name in this deployment's own FLWR_HOME


def free_port() -> int:
    """A TCP port on the loopback that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _toml_value(value: ConfigValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string is a JSON string for these values


def run_config_arg(config: Mapping[str, ConfigValue]) -> str:
    """``flwr run --run-config`` text: space-separated TOML key=value pairs."""
    return " ".join(f"{k}={_toml_value(v)}" for k, v in config.items())


@dataclass(frozen=True)
class RunResult:
    run_id: int | None
    status: str  # Flower's, e.g. "finished:completed", "finished:failed"
    log: str  # what `flwr run --stream` printed: the ServerApp's log, its traceback included

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


def _int(value: JsonValue, what: str) -> int:
    """A number Flower printed in its JSON (a node or run id)."""
    if isinstance(value, int | float | str):
        return int(value)
    raise RuntimeError(f"flwr printed {what} {value!r}, not a number")


def _objects(value: JsonValue) -> list[JsonObject]:
    """The objects of a JSON array Flower printed (its nodes, its runs); [] for anything else."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _json(text: str) -> JsonObject:
    """The JSON object a ``flwr ... --format json`` command printed (after any plain lines), or {}."""
    start = text.find("{")
    try:
        data = json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class LocalDeployment:
    """``with LocalDeployment(workdir, n_nodes, bin_dir) as d: d.run(app_dir, {...})``. ``secure=False`` runs
    Flower's ``--insecure`` mode (no TLS, no node authentication)."""

    workdir: Path
    n_nodes: int
    bin: Path
    secure: bool = True
    node_config: dict[int, dict[str, ConfigValue]] = field(default_factory=dict)  # extra --node-config per partition
    start_timeout: float = 120.0
    port: int = 0
    node_ids: list[int] = field(default_factory=list)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _logs: list[TextIO] = field(default_factory=list)

    # ------------------------------------------------------------------------------------------------ environment
    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"  # SuperExec finds flwr-clientapp on PATH
        env["FLWR_HOME"] = str(self.workdir / "flwr-home")  # never the user's ~/.flwr
        env["FLWR_TELEMETRY_ENABLED"] = "0"
        env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def state_dir(self, partition: int) -> Path:
        return self.workdir / "state" / f"node{partition}"

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        self.log(name).parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log(name), "a", encoding="utf-8")  # noqa: SIM115 (closed in stop())
        self._logs.append(out)
        proc = subprocess.Popen(
            [str(self.bin / argv[0]), *argv[1:]],
            cwd=self.workdir,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() ends SuperExec and the apps with it
        )
        self._procs[name] = proc
        return proc

    def flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A ``flwr`` CLI command against this deployment's SuperLink."""
        return subprocess.run(
            [str(self.bin / "flwr"), *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    # ---------------------------------------------------------------------------------------------------- start
    def _pki(self, code: str, *args: str) -> None:
        """Run ``code`` with :mod:`.pki` imported, in the Flower venv (where ``cryptography`` is)."""
        head = "import sys; from pathlib import Path; from moetool.methods.comigs.pki import *; w = Path(sys.argv[1]); "
        argv = [str(self.bin / "python"), "-c", head + code, str(self.workdir), *args]
        subprocess.run(argv, check=True, timeout=60, env=self.env)

    def _credentials(self) -> None:
        """CA, server certificate and one key pair per SuperNode."""
        self._pki("make_server_credentials(w / 'certs', ['127.0.0.1', 'localhost'])")
        for i in range(self.n_nodes):
            self.new_key(f"node{i}")

    def new_key(self, name: str) -> None:
        """A fresh node key pair ``keys/<name>.key`` / ``.pub``."""
        self._pki("make_node_keys(w / 'keys', sys.argv[2])", name)

    def _write_flower_config(self) -> None:
        conn = [f'address = "{HOST}:{self.port}"']
        conn.append(f'root-certificates = "{self.workdir / "certs" / "ca.crt"}"' if self.secure else "insecure = true")
        home = self.workdir / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        text = f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n' + "\n".join(conn) + "\n"
        (home / "config.toml").write_text(text, encoding="utf-8")

    def _wait(self, what: str, ready: Callable[[], T], timeout: float) -> T:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self._procs.items():
                if name.startswith(("superlink", "supernode")) and proc.poll() is not None:
                    tail = self.log(name).read_text(encoding="utf-8", errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n{tail}")
            value = ready()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:g} s (logs: {self.workdir / 'logs'})")
            time.sleep(0.5)

    def _nodes(self) -> list[JsonObject]:
        res = self.flwr("supernode", "ls", CONNECTION, "--format", "json", timeout=30)
        return _objects(_json(res.stdout).get("nodes", [])) if res.returncode == 0 else []

    def _superlink_up(self) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(1)
            if s.connect_ex((HOST, self.port)) != 0:
                return False
        return self.flwr("supernode", "ls", CONNECTION, timeout=30).returncode == 0

    def start(self) -> LocalDeployment:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        if self.secure:
            self._credentials()
        self._write_flower_config()
        link = [
            "flower-superlink",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
        ]
        certs = self.workdir / "certs"
        if self.secure:
            link += ["--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.pem")]
            link += ["--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth"]
        else:
            link += ["--insecure"]
        self._spawn("superlink", link)
        self._wait("the SuperLink", self._superlink_up, self.start_timeout)
        for i in range(self.n_nodes):
            self.start_node(i)
        self._wait(f"{self.n_nodes} SuperNodes online", self._all_online, self.start_timeout)
        return self

    def _all_online(self) -> bool:
        online = [n for n in self._nodes() if str(n.get("status", "")).lower() == "online"]
        return len(online) >= self.n_nodes

    def _register(self, i: int) -> int:
        """Add node ``i``'s public key to the SuperLink (Flower's node authentication); returns its node id."""
        res = self.flwr(
            "supernode", "register", str(self.workdir / "keys" / f"node{i}.pub"), CONNECTION, "--format", "json"
        )
        data = _json(res.stdout)
        if res.returncode != 0 or "node-id" not in data:
            raise RuntimeError(f"flwr supernode register node{i} failed ({res.returncode}): {res.stdout}{res.stderr}")
        return _int(data["node-id"], "node-id")

    def start_node(self, i: int, *, key: str | None = None) -> subprocess.Popen[bytes]:
        """Start (or restart, with the same key and so the same node id) the SuperNode of partition ``i``. ``key``:
        sign in with ``keys/<key>.key`` instead, as it is, never registered (to see the SuperLink refuse it)."""
        config: dict[str, ConfigValue] = {
            "partition-id": i,
            "num-partitions": self.n_nodes,
            "state-dir": str(self.state_dir(i)),
        }
        config |= self.node_config.get(i, {})
        argv = ["flower-supernode", "--superlink", f"{HOST}:{self.port}", "--node-config", run_config_arg(config)]
        argv += ["--host", HOST, "--port", str(free_port())]  # its Runtime API, for its own SuperExec
        if self.secure:
            if key is None and len(self.node_ids) <= i:
                self.node_ids.append(self._register(i))
            certs = self.workdir / "certs"
            argv += ["--root-certificates", str(certs / "ca.crt")]
            argv += ["--auth-supernode-private-key", str(self.workdir / "keys" / f"{key or f'node{i}'}.key")]
            # its Runtime API (its SuperExec and ClientApps call it on 127.0.0.1) under the same CA
            argv += ["--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key")]
            argv += ["--ssl-ca-certfile", str(certs / "ca.crt")]
        else:
            argv += ["--insecure"]
        return self._spawn(key or f"supernode{i}", argv)

    def node_status(self, i: int) -> str:
        """The SuperLink's view of SuperNode ``i``: "online", "offline", "registered", ... ("" when not listed)."""
        ids = self.node_ids[i] if self.secure else None
        return next(
            (str(n.get("status")) for n in self._nodes() if ids is not None and _int(n["node-id"], "node-id") == ids),
            "",
        )

    def restart_node(self, i: int, timeout: float = 180) -> None:
        """Start SuperNode ``i`` again after a crash. The SuperLink lets its key back in only once it has marked the
        old process offline (about 60 s after its last heartbeat), so wait for that, then for it to be online."""
        if not self.secure:
            raise ValueError("restart_node needs node authentication (secure=True) to keep the node id")
        self._wait(f"SuperNode {i} marked offline", lambda: self.node_status(i) == "offline", timeout)
        self.start_node(i)
        self._wait(f"SuperNode {i} online again", lambda: self.node_status(i) == "online", timeout)

    # ------------------------------------------------------------------------------------------------------ runs
    def run_argv(self, app: Path, run_config: Mapping[str, ConfigValue]) -> list[str]:
        return [
            str(self.bin / "flwr"),
            "run",
            str(app),
            CONNECTION,
            "--stream",
            "--run-config",
            run_config_arg(run_config),
        ]

    def submit(
        self, app: Path, run_config: Mapping[str, ConfigValue], log_name: str = "flwr-run"
    ) -> subprocess.Popen[bytes]:
        """Start ``flwr run --stream`` without waiting (its output goes to logs/<log_name>.log)."""
        self.log(log_name).parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log(log_name), "w", encoding="utf-8")  # noqa: SIM115 (closed in stop())
        self._logs.append(out)
        proc = subprocess.Popen(
            self.run_argv(app, run_config),
            cwd=self.workdir,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs[log_name] = proc
        return proc

    def finish(self, proc: subprocess.Popen[bytes], log_name: str = "flwr-run", timeout: float = 600) -> RunResult:
        """Wait for a submitted ``flwr run`` and ask the SuperLink how its run ended (``flwr run`` itself exits 0
        when the ServerApp fails)."""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(log_name, signal.SIGKILL)
            raise TimeoutError(
                f"flwr run did not finish within {timeout:g} s (logs: {self.workdir / 'logs'})"
            ) from None
        self._procs.pop(log_name, None)
        log = self.log(log_name).read_text(encoding="utf-8", errors="replace")
        found = re.search(r"Successfully started run (\d+)", log)
        if found is None:
            return RunResult(None, f"not started (flwr run exit {proc.returncode})", log)
        run_id = int(found.group(1))
        listed = _json(self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json").stdout)
        runs = _objects(listed.get("runs", []))
        return RunResult(run_id, str(runs[0].get("status", "unknown")) if runs else "unknown", log)

    def run(self, app: Path, run_config: Mapping[str, ConfigValue], timeout: float = 600) -> RunResult:
        """``flwr run`` to its end."""
        return self.finish(self.submit(app, run_config), timeout=timeout)

    # ------------------------------------------------------------------------------------------------------ stop
    def _kill(self, name: str, sig: int) -> None:
        proc = self._procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def kill_node(self, i: int) -> None:
        """SIGKILL SuperNode ``i`` with its SuperExec and ClientApp: a device crashing, with no goodbye."""
        name = f"supernode{i}"
        self._kill(name, signal.SIGKILL)
        self._procs[name].wait(timeout=30)
        self._procs.pop(name)

    def stop(self) -> None:
        """SIGTERM every process group (SuperNodes first), SIGKILL what is left after 10 s."""
        names = sorted(self._procs, key=lambda n: n == "superlink")
        for name in names:
            self._kill(name, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for name in names:
            proc = self._procs[name]
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            self._kill(name, signal.SIGKILL)  # the group too: a SuperExec may outlive its SuperNode
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> LocalDeployment:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
