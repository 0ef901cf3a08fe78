"""The provenance hashes' cache: same digests as hashlib, reused only for unchanged files."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from moetool.io import hashes


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    out = []
    for i, size in enumerate((0, 1, (1 << 22) + 3)):  # empty, tiny, and over one read block
        p = tmp_path / f"w{i}.safetensors"
        p.write_bytes(bytes((i * 7 + j) % 251 for j in range(size)))
        out.append(p)
    return out


def test_digests_equal_hashlib_and_are_reused(
    files: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache.json"
    monkeypatch.setattr(hashes, "RACY_NS", 0)  # the files were just written; let them count as settled
    first = hashes.cached_sha256(files, cache=cache)
    assert first == {f: _digest(f) for f in files}
    assert len(json.loads(cache.read_text())) == len(files)

    def unread(path: Path, chunk: int = 0) -> str:
        raise AssertionError(f"{path} hashed again although unchanged")

    monkeypatch.setattr(hashes, "sha256_file", unread)
    assert hashes.cached_sha256(files, cache=cache) == first


def test_a_rewritten_file_is_hashed_again(files: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache.json"
    monkeypatch.setattr(hashes, "RACY_NS", 0)
    hashes.cached_sha256(files, cache=cache)
    target = files[1]
    time.sleep(0.05)  # past the file system clock's tick: a rewrite inside it is the racy case RACY_NS guards
    target.write_bytes(b"\xff")  # same size, other content: only the change time tells
    assert hashes.cached_sha256([target], cache=cache)[target] == _digest(target)


def test_a_file_written_just_now_is_not_remembered(files: list[Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    assert hashes.cached_sha256(files, cache=cache) == {f: _digest(f) for f in files}
    assert not cache.exists()  # every file is within RACY_NS of its hashing


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"x": [1, 2, 3]}'])
def test_a_malformed_cache_counts_as_empty(files: list[Path], tmp_path: Path, content: str) -> None:
    cache = tmp_path / "cache.json"
    cache.write_text(content)
    assert hashes.cached_sha256(files, cache=cache) == {f: _digest(f) for f in files}


def test_an_unwritable_cache_does_not_fail(files: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashes, "RACY_NS", 0)
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = blocker / "cache.json"  # its parent is a file: the write fails
    assert hashes.cached_sha256(files, cache=cache) == {f: _digest(f) for f in files}
