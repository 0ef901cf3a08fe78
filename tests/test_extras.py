"""moetool.extras: one helper for optional dependencies, one install command per extra, the README's."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from moetool.errors import MoetoolError
from moetool.extras import MissingExtraError, install_hint, require

ROOT = Path(__file__).resolve().parents[1]


def test_require_returns_the_module():
    assert require("json", "onnx") is sys.modules["json"]


def test_a_missing_module_names_the_extra_and_its_command():
    with pytest.raises(MissingExtraError) as info:
        require("moetool_no_such_module", "onnx", why="ONNX export", otherwise="pick another target")
    err = info.value
    assert isinstance(err, MoetoolError) and (err.module, err.extra) == ("moetool_no_such_module", "onnx")
    assert str(err) == (
        "ONNX export needs moetool_no_such_module (the onnx extra), which is not installed: "
        "bash scripts/setup.sh --onnx (or pip install 'moetool[onnx]'); or pick another target"
    )


def test_a_missing_dependency_of_the_module_is_named_too(monkeypatch, tmp_path):
    (tmp_path / "moetool_half_installed.py").write_text("import moetool_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        MissingExtraError, match=r"needs moetool_half_installed \(moetool_absent_dependency is missing\)"
    ):
        require("moetool_half_installed", "coreml")


def test_every_extra_has_the_setup_option_the_message_names():
    """Each runtime extra's message starts with ``bash scripts/setup.sh --<extra>``, an option setup.sh accepts."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    options = set(re.findall(r"^\s+--([a-z]+)\)", (ROOT / "scripts" / "setup.sh").read_text(), re.M))
    for extra in set(extras) - {"dev"}:
        assert install_hint(extra).startswith(f"bash scripts/setup.sh --{extra}"), extra
        assert extra in options, f"scripts/setup.sh has no --{extra}"
