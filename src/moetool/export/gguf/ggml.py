"""ggml's own row quantizer and dequantizer, called in the library llama-cpp-python ships (``libggml-base``).

The same functions llama.cpp's quantizer runs per tensor (``ggml_quantize_chunk`` with the importance of one matrix),
so bytes made here equal llama.cpp's; moetool uses them to measure what a type costs a tensor before choosing it,
and the tests to check that the GGUF's bytes are llama.cpp's.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from moetool.extras import require


@functools.cache
def _lib() -> ctypes.CDLL:
    llama_cpp = require(
        "llama_cpp",
        "llama",
        why="ggml's quantizer (K and IQ types, importance-weighted rounding, bit allocation)",
        otherwise="choose a plan of f16/bf16/q8_0/q5_x/q4_x types, without --imatrix",
    )
    lib = ctypes.CDLL(str(Path(str(llama_cpp.__file__)).parent / "lib" / "libggml-base.so"))
    f = ctypes.POINTER(ctypes.c_float)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        f,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        f,
    ]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.restype = None
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return lib


def _type_id(name: str) -> int:
    import gguf

    return int(getattr(gguf.GGMLQuantizationType, name.upper()))


def _fptr(a: np.ndarray | None) -> ctypes._Pointer[ctypes.c_float] | None:
    return None if a is None else a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def requires_imatrix(type_name: str) -> bool:
    """Whether ggml itself refuses ``type_name`` without importance weights."""
    return bool(_lib().ggml_quantize_requires_imatrix(_type_id(type_name)))


def quantize(rows: np.ndarray, type_name: str, importance: np.ndarray | None = None) -> bytes:
    """``rows`` (``[n, n_per_row]``, one matrix) in ``type_name``, rounded with ``importance`` (``[n_per_row]``, the
    mean x² per column) as llama.cpp's quantizer rounds it."""
    return quantize_rows(rows, type_name, importance).tobytes()


def quantize_rows(
    rows: np.ndarray, type_name: str, importance: np.ndarray | None = None, *, threads: int = 1
) -> np.ndarray:
    """As :func:`quantize`, as a ``uint8`` array; ``threads`` quantize disjoint row ranges at once (each row is
    rounded on its own, so the bytes do not depend on the split)."""
    lib = _lib()
    t = _type_id(type_name)
    if importance is None and lib.ggml_quantize_requires_imatrix(t):
        raise ValueError(f"{type_name} needs importance weights (ggml aborts the process without them)")
    x = np.ascontiguousarray(rows, dtype=np.float32)
    n, per_row = x.shape
    imp = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    if imp is not None and imp.shape != (per_row,):
        raise ValueError(f"importance has shape {imp.shape}; rows of {per_row} need ({per_row},)")
    lib.ggml_quantize_init(t)  # once, before any thread: it fills the IQ types' shared tables
    out = np.empty(int(lib.ggml_row_size(t, per_row)) * n, dtype=np.uint8)
    src, dst, w = _fptr(x), out.ctypes.data, _fptr(imp)
    bounds = np.linspace(0, n, max(1, min(threads, n)) + 1).astype(int)

    def chunk(a: int, b: int) -> int:
        # ctypes lets go of the GIL for the call: the ranges run in parallel
        return int(lib.ggml_quantize_chunk(t, src, dst, a * per_row, b - a, per_row, w))

    if len(bounds) == 2:
        wrote = chunk(0, n)
    else:
        with ThreadPoolExecutor(len(bounds) - 1) as pool:
            wrote = sum(pool.map(chunk, bounds[:-1], bounds[1:]))
    if wrote != out.size:
        raise RuntimeError(f"ggml_quantize_chunk wrote {wrote} bytes, expected {out.size}")
    return out


@functools.cache
def _dequantizer(
    type_name: str,
) -> Callable[[ctypes.Array[ctypes.c_char], ctypes._Pointer[ctypes.c_float] | None, int], None]:
    name = type_name.lower()
    symbol = "dequantize_row_" + (name[:-2] + "_K" if name.endswith("_k") else name)
    fn = _lib()[symbol]
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64]
    return fn


def dequantize(data: bytes, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Float32 values of ``data`` (``type_name``) in ``shape``, by ggml's own row dequantizer."""
    out = np.empty(shape, dtype=np.float32)
    buf = ctypes.create_string_buffer(data, len(data))
    _dequantizer(type_name)(buf, _fptr(out), out.size)
    return out


def round_trip(rows: np.ndarray, type_name: str, importance: np.ndarray | None = None) -> np.ndarray:
    """``rows`` quantized to ``type_name`` and back (a float type: cast and back)."""
    if type_name == "f32":
        return np.asarray(rows, dtype=np.float32).copy()
    if type_name == "f16":
        return np.asarray(rows, dtype=np.float32).astype(np.float16).astype(np.float32)
    if type_name == "bf16":
        import torch

        return torch.from_numpy(np.asarray(rows, dtype=np.float32)).bfloat16().float().numpy()
    return dequantize(quantize(rows, type_name, importance), type_name, rows.shape)
