"""Property tests: any bytes given to the recipe loader or the safetensors header reader give a result or a
MoetoolError, never another exception (no JSONDecodeError, UnicodeDecodeError, RecursionError, MemoryError, …)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from moetool.errors import MoetoolError
from moetool.io.checkpoint import TensorInfo, read_safetensors_header
from moetool.io.safe import parse_json, parse_yaml
from moetool.recipe.base import RecipeBase
from moetool.recipe.load import parse_recipe

# FUZZ_EXAMPLES=5000 for a longer hunt; no example database (nothing written into the checkout)
FAST = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

GOOD = b"""\
name: fuzz
method: mofe
base_model: zoo:base
gate_mode: hidden
experts_per_token: 1
experts:
  - name: a
    source: zoo:code
    positive_prompts: ["def main(): import os"]
    negative_prompts: ["licence"]
  - name: b
    source: zoo:legal
    positive_prompts: ["Permission is hereby granted"]
train: {steps: 10, learning_rate: 1e-3}
quantization: {preset: gem}
"""


def _recipe_result(data: bytes | str) -> None:
    try:
        r = parse_recipe(data, Path("fuzz.yaml"))
    except MoetoolError as exc:
        assert "fuzz.yaml" in str(exc), exc
    else:
        assert isinstance(r, RecipeBase)


@FAST
@given(st.binary(max_size=2000))
def test_recipe_loader_any_bytes(data):
    _recipe_result(data)


@FAST
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=500))
def test_recipe_loader_any_text(text):
    _recipe_result(text)


YAML_TOKENS = [
    "name:", "method:", "mofe", "experts:", "- ", "  ", "\n", "&a ", "*a", "[", "]", "{", "}", ",", ":", "? ", "!!str ",
    "!!int ", "!!python/name:os.system", "<<: ", '"', "'", "#", "---", "...", "|", ">", "1", "-1", "1e3", "0x1f",
    "true", "null", "~", ".nan", "2001-02-30", "experts_per_token:", "source:", "positive_prompts:", "%YAML 1.1\n",
    "\t", "\x00", "\ufeff",
]  # fmt: skip


@FAST
@given(st.lists(st.sampled_from(YAML_TOKENS), max_size=80))
def test_recipe_loader_yaml_token_soup(tokens):
    _recipe_result("".join(tokens))


@FAST
@given(st.integers(0, len(GOOD) - 1), st.binary(min_size=1, max_size=8), st.booleans())
def test_recipe_loader_mutated_good_recipe(pos, patch, insert):
    data = GOOD[:pos] + patch + GOOD[pos if insert else pos + len(patch) :]
    _recipe_result(data)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@FAST
@given(st.dictionaries(st.sampled_from(["name", "method", "base_model", "experts", "experts_per_token", "gate_mode",
                                        "seed", "train", "freeze", "targets"]), JSON, max_size=8))  # fmt: skip
def test_recipe_loader_structured_values(doc):
    doc.setdefault("method", "mofe")
    _recipe_result(yaml.safe_dump(doc))


# --- safetensors headers ---------------------------------------------------------------------------------------------


def _header_result(path: Path) -> None:
    try:
        h = read_safetensors_header(path)
    except MoetoolError as exc:
        assert str(path) in str(exc), exc
    else:
        assert all(isinstance(v, TensorInfo) for v in h.values())
        size = path.stat().st_size
        assert all(v.offset + v.nbytes <= size for v in h.values())


@FAST
@given(st.binary(max_size=512))
def test_header_reader_any_bytes(tmp_path, data):
    p = tmp_path / "model.safetensors"
    p.write_bytes(data)
    _header_result(p)


@FAST
@given(st.binary(max_size=512), st.integers(0, 2**64 - 1))
def test_header_reader_any_length(tmp_path, data, n):
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", n) + data)
    _header_result(p)


ENTRY = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "Q4", ""]) | JSON,
        "shape": st.lists(st.integers(-2, 6), max_size=3) | JSON,
        "data_offsets": st.lists(st.integers(-8, 200), min_size=0, max_size=3) | JSON,
    },
)


@FAST
@given(st.dictionaries(st.text(max_size=6), ENTRY | JSON, max_size=4), st.binary(max_size=256))
def test_header_reader_structured_headers(tmp_path, header, data):
    raw = json.dumps(header).encode()
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    _header_result(p)


@pytest.fixture(scope="module")
def real_file(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("st") / "m.safetensors"
    save_file({"a": torch.ones(3, 4), "b": torch.arange(6, dtype=torch.int64), "c": torch.zeros(0)}, str(p))
    return p.read_bytes()


@FAST
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6), st.integers(0, 400))
def test_header_reader_mutated_real_file(tmp_path, real_file, flips, cut):
    data = bytearray(real_file)
    for pos, byte in flips:
        if pos < len(data):
            data[pos] = byte
    p = tmp_path / "model.safetensors"
    p.write_bytes(bytes(data[: len(data) - cut]))
    _header_result(p)


@FAST
@given(st.binary(max_size=300))
def test_json_reader_any_bytes(data):
    try:
        parse_json(data, Path("config.json"), expect=None)
    except MoetoolError as exc:
        assert "config.json" in str(exc)


@FAST
@given(st.binary(max_size=300))
def test_yaml_reader_any_bytes(data):
    try:
        parse_yaml(data, Path("any.yaml"))
    except MoetoolError as exc:
        assert "any.yaml" in str(exc)
