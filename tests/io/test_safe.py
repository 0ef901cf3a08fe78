"""The input-safety layer: JSON, YAML and safetensors headers are bounded, strict, and fail with the file named."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moetool.errors import CheckpointError, InputFileError, MoetoolError, RecipeError
from moetool.io.checkpoint import Checkpoint, read_safetensors_header
from moetool.io.safe import parse_json, parse_yaml, read_json, read_yaml


def _st(path, header: bytes | str, data: bytes = b"", length: int | None = None):
    raw = header.encode() if isinstance(header, str) else header
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


# --- JSON ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "is not valid JSON"),
        (b"{", "config.json:1:2: model config is not valid JSON"),
        (b'{"a": 1,\n "b": }', "config.json:2:7"),
        (b"[1, 2]", "must be a JSON object"),
        ('{"name": "caf\xe9"}'.encode("latin-1"), "not UTF-8 text (byte 13"),
        (b'{"a": 1, "a": 2}', "has the key 'a' twice"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
        (b'{"n": ' + b"9" * 5000 + b"}", "cannot be parsed"),
    ],
)
def test_read_json_refuses_with_the_file_named(tmp_path, content, expected):
    p = tmp_path / "config.json"
    p.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        read_json(p, what="model config")
    msg = str(info.value)
    assert str(p) in msg and expected in msg, msg


def test_read_json_bounds_and_missing(tmp_path):
    p = tmp_path / "big.json"
    p.write_text(json.dumps({"a": "x" * 1000}))
    with pytest.raises(InputFileError, match="more than the 100 allowed"):
        read_json(p, error=InputFileError, max_bytes=100)
    with pytest.raises(CheckpointError, match="cannot read"):
        read_json(tmp_path / "nope.json")
    with pytest.raises(CheckpointError, match="a directory"):
        read_json(tmp_path)
    assert read_json(p) == {"a": "x" * 1000}
    assert parse_json('\ufeff{"a": 1}'.encode(), p) == {"a": 1}  # a UTF-8 BOM is fine


# --- YAML ------------------------------------------------------------------------------------------------------------


def _bomb(levels: int = 9) -> str:
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    prev = "a"
    for c in "bcdefghijk"[: levels - 1]:
        text += f"{c}: &{c} [" + ",".join([f"*{prev}"] * 9) + "]\n"
        prev = c
    return text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (_bomb(), "once aliases are expanded"),
        ("x: " + "[" * 10_000 + "]" * 10_000, "nested deeper than 64 levels"),
        ("x: " + "{a: " * 5000 + "1" + "}" * 5000, "nested deeper than 64 levels"),
        ("".join(" " * i + "- \n" for i in range(200)), "nested deeper than 64 levels"),
        ("a: &a 1\nb: [" + ",".join(["*a"] * 300) + "]\n", "more than 256 aliases"),
        ("a: 1\nb: 2\na: 3\n", "r.yaml:3: a: duplicate key 'a' (first at line 1)"),
        ("x:\n  - {k: 1, j: 2, k: 3}\n", "r.yaml:2: x.0.k: duplicate key 'k'"),
        ("a: 1\n---\nb: 2\n", "r.yaml:2: not valid YAML"),
        ("d: 2001-02-30\n", "a value YAML cannot read"),
        ("x: !!python/object:os.system ls\n", "could not determine a constructor"),
        ("? [a, b]\n: 1\n", "unhashable key"),
        ("a: [1\n", "not valid YAML"),
        ("a: b\x00\n", "not valid YAML"),
    ],
)
def test_yaml_budgets_and_duplicates(tmp_path, text, expected):
    t0 = time.perf_counter()
    with pytest.raises(InputFileError) as info:
        parse_yaml(text, tmp_path / "r.yaml")
    # refused before the document is built: a billion-laughs expansion would take minutes; 5 s leaves room for a
    # loaded CI machine (1.1 s was seen with both cores busy)
    assert time.perf_counter() - t0 < 5.0
    assert expected in str(info.value) and "r.yaml" in str(info.value)


def test_yaml_merge_keys_floats_and_lines(tmp_path):
    value, lines = parse_yaml("base: &b {x: 1, y: 2}\nitem:\n  <<: *b\n  x: 3\nlr: 1e-3\nn: 2e5\n", tmp_path / "r")
    assert value["item"] == {"x": 3, "y": 2}  # an explicit key overrides a merged one: not a duplicate
    assert value["lr"] == 0.001 and value["n"] == 200000.0  # YAML 1.2 floats without a dot
    assert lines[("item", "x")] == 4 and lines[("lr",)] == 5
    assert parse_yaml("", tmp_path / "r")[0] is None


def test_read_yaml_encodings(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(RecipeError, match=r"r.yaml:1: recipe is not UTF-8 text \(byte 9"):
        read_yaml(p, what="recipe", error=RecipeError)
    p.write_bytes("name: café\n".encode())
    assert read_yaml(p) == {"name": "café"}
    p.write_bytes(b"x: " + b"a" * 2000)
    with pytest.raises(InputFileError, match="more than the 1,000 allowed"):
        read_yaml(p, max_bytes=1000)


# --- safetensors headers ---------------------------------------------------------------------------------------------

GOOD_HEADER = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: p.write_bytes(b""), "0 bytes, shorter than the 8-byte header length"),
        (lambda p: p.write_bytes(b"\x01\x02\x03"), "3 bytes, shorter than"),
        (lambda p: _st(p, "{}", length=2**62), "over the 100,000,000-byte limit"),
        (lambda p: _st(p, "{}", length=5000), "runs past the end"),
        (lambda p: _st(p, "{not json"), "safetensors header is not valid JSON"),
        (lambda p: _st(p, b"\xff\xfe{}"), "safetensors header is not UTF-8"),
        (lambda p: _st(p, "[1, 2]"), "must be a JSON object"),
        (lambda p: _st(p, '{"w": 1, "w": 2}'), "has the key 'w' twice"),
        (lambda p: _st(p, json.dumps({"w": [1]})), "tensor 'w': header entry must be an object"),
        (lambda p: _st(p, json.dumps({"w": {**GOOD_HEADER["w"], "dtype": "Q9"}}), b"\0" * 16), "unknown dtype 'Q9'"),
        (lambda p: _st(p, json.dumps({"w": {**GOOD_HEADER["w"], "shape": [-1]}}), b"\0" * 16), "shape must be"),
        (lambda p: _st(p, json.dumps({"w": {**GOOD_HEADER["w"], "shape": "2x2"}}), b"\0" * 16), "shape must be"),
        (lambda p: _st(p, json.dumps({"w": {**GOOD_HEADER["w"], "shape": [True]}}), b"\0" * 16), "shape must be"),
        (lambda p: _st(p, json.dumps({"w": {**GOOD_HEADER["w"], "data_offsets": [8, 0]}}), b"\0" * 16), "begin <="),
        (lambda p: _st(p, json.dumps({"w": {**GOOD_HEADER["w"], "data_offsets": [0]}}), b"\0" * 16), "data_offsets"),
        (lambda p: _st(p, json.dumps({"w": {**GOOD_HEADER["w"], "data_offsets": [0, 8]}}), b"\0" * 16), "needs 16"),
        (lambda p: _st(p, json.dumps(GOOD_HEADER), b"\0" * 10), "past the end of the"),
        (lambda p: _st(p, json.dumps({"__metadata__": [1]})), "__metadata__ must be an object"),
        (lambda p: p.write_bytes(bytes(range(256)) * 16), "header length"),
    ],
)
def test_corrupt_safetensors_headers(tmp_path, make, expected):
    p = tmp_path / "model.safetensors"
    make(p)
    with pytest.raises(CheckpointError) as info:
        read_safetensors_header(p)
    assert str(p) in str(info.value) and expected in str(info.value), str(info.value)


def test_header_of_a_real_file(tmp_path):
    save_file({"a": torch.ones(2, 3), "b": torch.zeros(0)}, str(tmp_path / "m.safetensors"))
    h = read_safetensors_header(tmp_path / "m.safetensors")
    assert h["a"].shape == (2, 3) and h["a"].nbytes == 24 and h["b"].numel == 0


def test_unread_dtype_is_named_on_get(tmp_path):
    _st(
        tmp_path / "model.safetensors",
        json.dumps({"q": {"dtype": "U32", "shape": [2], "data_offsets": [0, 8]}}),
        b"\0" * 8,
    )
    (tmp_path / "config.json").write_text("{}")
    ck = Checkpoint(tmp_path)
    assert ck.tensors["q"].nbytes == 8
    with pytest.raises(CheckpointError, match="dtype U32, which moetool cannot read"):
        ck.get("q")


# --- checkpoints: config and index -----------------------------------------------------------------------------------


def _sharded(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_index_naming_a_missing_shard_names_both(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        Checkpoint(tmp_path).tensors  # noqa: B018
    msg = str(info.value)
    assert "model.safetensors.index.json" in msg and "model-00002-of-00002.safetensors" in msg and "missing" in msg


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        ("{", "safetensors index is not valid JSON"),
        ('{"weight_map": [1]}', "weight_map must be an object"),
        ('{"weight_map": {"a": 3}}', "weight_map must be an object"),
        ('{"weight_map": {"a": "../../etc/passwd"}}', "is not a file name in"),
        (
            '{"weight_map": {"a": "model-00001-of-00002.safetensors", "zz": "model-00001-of-00002.safetensors"}}',
            "tensor 'zz' should be in shard",
        ),
    ],
)
def test_malformed_index(tmp_path, index, expected):
    _sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(tmp_path).tensors  # noqa: B018
    assert "model.safetensors.index.json" in str(info.value) and expected in str(info.value)


def test_sharded_checkpoint_reads(tmp_path):
    ck = Checkpoint(_sharded(tmp_path))
    assert set(ck.tensors) == {"a", "b"} and torch.equal(ck.get("b"), torch.ones(3))
    ck.close()


@pytest.mark.parametrize("content", [b"{", b"[]", b"", '{"a": "\xe9"}'.encode("latin-1")])
def test_malformed_config_names_the_file(tmp_path, content):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        Checkpoint(tmp_path).config  # noqa: B018
    assert str(tmp_path / "config.json") in str(info.value)


def test_corrupt_pickle_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: cannot load pickle weights"):
        Checkpoint(tmp_path, allow_pickle=True).tensors  # noqa: B018
    with pytest.raises(MoetoolError, match="--allow-pickle"):
        Checkpoint(tmp_path).tensors  # noqa: B018


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_tensors_are_refused_on_read(tmp_path, value, monkeypatch):
    import moetool.io.checkpoint as ckmod

    monkeypatch.setattr(ckmod, "FINITE_CHUNK", 4)  # the bad value sits in a later chunk
    w = torch.zeros(5, 5, dtype=torch.bfloat16)
    w[4, 4] = value
    save_file({"w": w, "i": torch.arange(3)}, str(tmp_path / "model.safetensors"))
    ck = Checkpoint(tmp_path)
    assert torch.equal(ck.get("i"), torch.arange(3))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'w' has \d NaN and \d Inf values \(of 25\)"):
        ck.get("w")
    assert not torch.isfinite(Checkpoint(tmp_path, check_finite=False).get("w")).all()


def test_finite_values_whose_sum_overflows_are_accepted(tmp_path):
    """The finite check sums a chunk first; a sum that overflows to Inf from finite values is not an error."""
    w = torch.full((4,), 3e38, dtype=torch.float32)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    assert torch.equal(Checkpoint(tmp_path).get("w"), w)


# --- text: memory follows the file, not the maximum ------------------------------------------------------------------


def test_read_text_allocates_by_the_file_not_the_maximum(tmp_path):
    """A 4-EiB maximum is only a bound: reading a small file never asks for a buffer of the maximum (which fails
    under an address-space limit, ``ulimit -v``, with MemoryError)."""
    from moetool.io.safe import read_bytes, read_text

    p = tmp_path / "code.txt"
    p.write_text("def f():\n    return 1\n" * 100)
    assert read_text(p, max_bytes=2**62) == "def f():\n    return 1\n" * 100
    assert read_bytes(p, max_bytes=2**62) == p.read_bytes()


def _feed(fifo, payload: bytes) -> threading.Thread:
    """Write ``payload`` into ``fifo`` from a thread; a reader that stops early (its bound) ends the write."""

    def write() -> None:
        with contextlib.suppress(BrokenPipeError):
            fifo.write_bytes(payload)

    t = threading.Thread(target=write)
    t.start()
    return t


def test_read_bytes_of_a_file_whose_stat_size_is_zero(tmp_path):
    """/proc files and pipes report size 0: they are read whole in bounded chunks, and the bound still holds."""
    from moetool.io.safe import read_bytes

    assert b"Name:" in read_bytes(Path("/proc/self/status"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    payload = b"x" * (3 << 20)
    writer = _feed(fifo, payload)
    assert read_bytes(fifo, max_bytes=4 << 20) == payload
    writer.join()
    writer = _feed(fifo, payload)
    with pytest.raises(InputFileError, match="more than the 1,000,000 bytes allowed"):
        read_bytes(fifo, max_bytes=1_000_000, error=InputFileError)
    writer.join()
