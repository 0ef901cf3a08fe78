"""Text inputs under an address-space limit (``ulimit -v``, as containers and CI runners set one).

The real ``moetool`` executable reads a 100-line ``--data`` file under a 4 GB limit on its virtual memory. The safe
reader once asked for a buffer of its 4 GiB maximum up front, so every text input died with ``MemoryError`` there,
whatever the file's size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEXT, write_recipe
from moetool import api

pytestmark = pytest.mark.slow

MOETOOL = Path(sys.executable).with_name("moetool")
LIMIT_KB = 4_000_000  # ulimit -v takes KiB: about 3.8 GiB, under the reader's old 4 GiB buffer


@pytest.fixture(scope="module")
def moe(tiny_models, tmp_path_factory) -> Path:
    m = tiny_models("llama")
    tmp = tmp_path_factory.mktemp("limit-moe")
    experts = "".join(f"  - {{name: x{i}, source: {m[f'e{i}']}, positive_prompts: ['p{i} def']}}\n" for i in (1, 2))
    text = f"name: moe\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 1\nexperts:\n{experts}"
    return api.assemble(write_recipe(tmp / "moe.yaml", text), tmp / "moe")


@pytest.mark.skipif(not MOETOOL.exists(), reason="the moetool executable is not installed next to python")
def test_experts_list_reads_its_data_under_a_4gb_address_space_limit(moe, tmp_path):
    code = tmp_path / "code.txt"
    code.write_text(TEXT * 2, encoding="utf-8")
    report = tmp_path / "listing.json"
    cmd = f'ulimit -v {LIMIT_KB} && exec "$@"'
    args = [str(MOETOOL), "experts", "list", str(moe), "--data", f"code={code}", "-o", str(report)]
    res = subprocess.run(["bash", "-c", cmd, "bash", *args], check=False, capture_output=True, text=True, timeout=300)
    assert "MemoryError" not in res.stderr, res.stderr
    assert res.returncode == 0, res.stderr
    listing = json.loads(report.read_text())
    assert listing["experts"] == ["x1", "x2"] and "code" in listing["routing"]["domains"]
