"""Fault suite fixtures: private copies of the tiny models, a runner that checks the invariants of every bad input."""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner, Result

from moetool.cli import app


def tree_digest(paths: Iterable[Path]) -> dict[str, str]:
    """sha256 of every file under ``paths`` (files or directories), keyed by path; symlinks by their target text."""
    out: dict[str, str] = {}
    for given in paths:
        root = Path(given)
        if not root.exists() and not root.is_symlink():
            out[str(root)] = "<absent>"
            continue
        files = [root] if not root.is_dir() else sorted(root.rglob("*"))
        for p in files:
            if p.is_symlink():
                out[str(p)] = "link:" + str(p.readlink())
            elif p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[str(p)] = "<dir>"
    return out


def leftovers(parent: Path) -> list[str]:
    """moetool temp or displaced-output dirs anywhere under ``parent``."""
    return sorted(str(p) for p in Path(parent).rglob("*") if ".moetool-tmp-" in p.name or ".moetool-old-" in p.name)


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@dataclass
class Env:
    """A sandbox: ``models`` (private copies of base/e1/e2), ``outs`` (where outputs go), ``work`` (the cwd)."""

    root: Path
    models: dict[str, Path]
    outs: Path
    work: Path

    def recipe(self, text: str | bytes, name: str = "r.yaml") -> Path:
        p = self.work / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return p


@pytest.fixture
def env(tmp_path, tiny_models, monkeypatch) -> Env:
    src = tiny_models("llama")
    models = {}
    for k in ("base", "e1", "e2"):
        models[k] = tmp_path / "models" / k
        shutil.copytree(src[k], models[k])
    outs = tmp_path / "outs"
    outs.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return Env(tmp_path, models, outs, work)


runner = CliRunner()


@pytest.fixture
def cli() -> Callable[[list[str]], Result]:
    """``cli(ARGS)``: run ``moetool ARGS`` in-process."""
    return lambda args: runner.invoke(app, args)


@pytest.fixture
def tools() -> SimpleNamespace:
    """The helpers of this conftest for test modules (which cannot import it by name)."""
    return SimpleNamespace(tree_digest=tree_digest, leftovers=leftovers, squash=squash, runner=runner, app=app)


@pytest.fixture
def refused() -> Callable[..., Result]:
    """``refused(ARGS, EXPECTED, inputs=…, sandbox=…)``: see :func:`run_refused`."""
    return run_refused


def run_refused(
    args: list[str],
    expected: Iterable[str],
    *,
    inputs: Iterable[Path],
    sandbox: Path,
    allowed_new: Callable[[Path], bool] = lambda p: False,
) -> Result:
    """Run ``moetool ARGS`` in-process and assert the contract for bad input.

    Exit code 2; every ``expected`` text in the message (whitespace-insensitive); no traceback and no exception other
    than the exit; every input byte-identical; nothing new under ``sandbox`` (no output, no temp dir) except paths
    ``allowed_new`` accepts.
    """
    inputs = list(inputs)
    before_in = tree_digest(inputs)
    before_all = set(tree_digest([sandbox]))
    res = runner.invoke(app, args)
    text = squash(res.output)
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), (
        f"{type(res.exception).__name__}: {res.exception}\n{res.output}"
    )
    assert res.exit_code == 2, f"exit {res.exit_code}:\n{res.output}"
    for e in expected:
        assert squash(e) in text, f"{e!r} not in:\n{res.output}"
    assert tree_digest(inputs) == before_in, "an input changed"
    new = [p for p in set(tree_digest([sandbox])) - before_all if not allowed_new(Path(p))]
    assert not new, f"written: {sorted(new)}"
    # a leftover given as the input itself (exporting a killed run's temp dir) is refused and stays untouched
    assert not [p for p in leftovers(sandbox) if Path(p) not in {Path(i) for i in inputs}]
    return res
