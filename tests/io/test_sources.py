"""Source plugins (``zoo:NAME``): the lower layers reach the zoo through registry.SOURCES, never by import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from moetool import registry
from moetool.errors import SourceError
from moetool.io.sources import resolve_source, source_resolver

SRC = Path(__file__).resolve().parents[2] / "src" / "moetool"
BELOW_THE_ZOO = ("io", "train", "export", "eval", "package", "card.py", "edit", "inspect.py", "recipe", "quant", "arch")


def test_the_zoo_is_a_registered_source_plugin():
    zoo = source_resolver("zoo")
    assert registry.SOURCES["zoo"] == "moetool.zoo.plugin:SOURCE"
    assert zoo.scheme == "zoo" and zoo.domains == ("code", "legal", "medical")
    assert callable(zoo.resolve) and callable(zoo.domain_text)


def test_an_unknown_scheme_names_the_known_ones():
    with pytest.raises(registry.UnknownPluginError, match=r"unknown source scheme 'zo' \(did you mean 'zoo'"):
        source_resolver("zo")


def test_a_zoo_reference_resolves_through_the_plugin(monkeypatch, tmp_path):
    monkeypatch.setattr(source_resolver("zoo"), "resolve", lambda name: tmp_path / name)
    got = resolve_source("zoo:code")
    assert got.path == tmp_path / "code" and got.kind == "zoo"
    monkeypatch.setattr(source_resolver("zoo"), "resolve", lambda name: (_ for _ in ()).throw(SourceError("none")))
    with pytest.raises(SourceError, match="none"):
        resolve_source("zoo:code")


def test_no_layer_below_the_zoo_names_it():
    """Not by import (the import contracts check that) and not by a "moetool.zoo" string either: only the registry."""
    naming = []
    for part in BELOW_THE_ZOO:
        for path in sorted((SRC / part).rglob("*.py")) if (SRC / part).is_dir() else [SRC / part]:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings may name it
            strings = [
                n.value
                for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            ]
            if any("moetool.zoo" in s for s in strings):
                naming.append(str(path.relative_to(SRC)))
    assert not naming, f"reach the zoo through moetool.io.sources.source_resolver, not by name: {naming}"
