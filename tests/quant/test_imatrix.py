"""Reading an importance matrix file: a malformed one is refused by name (ImatrixError), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetool.quant.imatrix import ImatrixError, ImportanceMatrix, load

INFO_KEY = "moetool.imatrix.info"  # moetool's own record in the file (llama.cpp ignores it)

SUMS = np.arange(12, dtype=np.float32).reshape(3, 4)  # 3 experts x 4 columns
COUNTS = np.array([[5.0], [6.0], [7.0]], dtype=np.float32)


def write_imatrix(
    path: Path,
    *,
    info: Any = None,
    sums: np.ndarray = SUMS,
    counts: np.ndarray = COUNTS,
    name: str = "blk.0.ffn_up_exps.weight",
) -> Path:
    """An imatrix GGUF as llama-imatrix lays it out, with ``info`` written as given (a str is not JSON-encoded)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="")
    for kv in w.kv_data:
        kv.pop(gguf.Keys.General.ARCHITECTURE, None)
    w.add_type(gguf.GGUFType.IMATRIX)
    w.add_array(gguf.Keys.IMatrix.DATASETS, ["code"])
    w.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, 2)
    w.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, 512)
    if info is not None:
        w.add_string(INFO_KEY, info if isinstance(info, str) else json.dumps(info))
    w.add_tensor(name + ".in_sum2", np.ascontiguousarray(sums, dtype=np.float32))
    w.add_tensor(name + ".counts", np.ascontiguousarray(counts, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_well_formed_file_round_trips(tmp_path):
    m = ImportanceMatrix(datasets=["code"], chunk_count=2, chunk_size=512, info={"mode": "routed"})
    m.add("blk.0.ffn_up_exps.weight", SUMS.astype(np.float64), COUNTS.reshape(-1).astype(np.float64))
    m.save(tmp_path / "m.imatrix.gguf")
    back = load(tmp_path / "m.imatrix.gguf")
    assert back.info == {"mode": "routed"} and back.datasets == ["code"] and back.chunk_count == 2
    assert np.array_equal(back.entries["blk.0.ffn_up_exps.weight"].sums, SUMS)
    assert load(write_imatrix(tmp_path / "llama.imatrix.gguf")).info == {}  # llama-imatrix writes no moetool record


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"info": "{not json"}, f"{INFO_KEY} is not valid JSON"),
        ({"info": "[1, 2]"}, f"{INFO_KEY} must be a JSON object"),
        ({"info": {"routed_tokens": "many"}}, "routed_tokens must map tensor names to lists of token counts"),
        ({"sums": np.arange(10, dtype=np.float32)}, "holds 10 sums for 3 counts"),
        ({"counts": np.zeros((0,), dtype=np.float32)}, "holds 12 sums for 0 counts"),
        ({"sums": np.full((3, 4), np.nan, dtype=np.float32)}, "12 NaN, 0 infinite and 0 negative values"),
        ({"counts": np.array([[5.0], [-1.0], [np.inf]], dtype=np.float32)}, "0 NaN, 1 infinite and 1 negative"),
    ],
)
def test_a_malformed_file_is_refused_by_name(tmp_path, kwargs, expected):
    path = write_imatrix(tmp_path / "bad.imatrix.gguf", **kwargs)
    with pytest.raises(ImatrixError) as info:
        load(path)
    assert str(path) in str(info.value) and expected in str(info.value), str(info.value)
