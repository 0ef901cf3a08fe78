"""The streaming shard writer and the seek-based reader agree with the safetensors library."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetool.errors import SourceError
from moetool.io.checkpoint import Checkpoint
from moetool.io.writer import ShardedWriter

TENSORS = {
    "a": torch.randn(3, 5),
    "b": torch.randn(7).to(torch.bfloat16),
    "empty": torch.zeros(0, 4),
    "c": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    "d": torch.randn(2, 2, 2).to(torch.float16),
}


def _write(out, max_bytes):
    layout = [(k, v.dtype, tuple(v.shape)) for k, v in TENSORS.items()]
    with ShardedWriter(out, layout, max_bytes) as w:
        for k, v in TENSORS.items():
            w.add(k, v)
    return w


@pytest.mark.parametrize("max_bytes", [10**9, 64])
def test_round_trip_through_safetensors(tmp_path, max_bytes):
    w = _write(tmp_path, max_bytes)
    got = {}
    for f in w.files:
        got |= load_file(str(tmp_path / f))
    assert set(got) == set(TENSORS)
    for k, v in TENSORS.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    if max_bytes == 64:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(w.files) > 2 and set(index["weight_map"]) == set(TENSORS)
    else:
        assert w.files == ["model.safetensors"]


def test_out_of_order_and_incomplete_are_errors(tmp_path):
    layout = [("x", torch.float32, (2,)), ("y", torch.float32, (2,))]
    w = ShardedWriter(tmp_path, layout, 10**6)
    with pytest.raises(ValueError, match="expected x"):
        w.add("y", torch.zeros(2))
    w.add("x", torch.zeros(2))
    with pytest.raises(ValueError, match="1 tensors unwritten"):
        w.close()


def test_reader_matches_safetensors(tmp_path):
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ck = Checkpoint(tmp_path)
    for k, v in TENSORS.items():
        assert torch.equal(ck.get(k), v)
        assert ck.tensors[k].shape == tuple(v.shape)
    with pytest.raises(SourceError, match="missing tensor 'nope'"):
        ck.get("nope")
    ck.close()
