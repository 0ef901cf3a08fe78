"""llama.cpp's own whole-file quantizer (``llama_model_quantize``, what ``llama-quantize`` runs), as the reference
moetool's tensor-by-tensor quantizer is held to: the bytes must be the same."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

from moetool.quant.imatrix import ImportanceMatrix


def llama_quantize(src: Path, dst: Path, types: dict[str, str], imatrix: ImportanceMatrix | None = None) -> None:
    """Quantize the f32 GGUF ``src`` into ``dst`` with one exact-name override per tensor (GGUF name → type) and,
    where given, ``imatrix``'s values passed as llama.cpp's C array."""
    override = llama_cpp.llama_model_tensor_override
    arr = (override * (len(types) + 1))()
    keep: list[object] = []  # buffers the C call reads: alive until it returns
    for i, (name, ty) in enumerate(types.items()):
        pat = ("^" + name.replace(".", r"\.") + "$").encode()
        keep.append(pat)
        arr[i].pattern = pat
        arr[i].type = int(gguf.GGMLQuantizationType[ty.upper()])
    arr[len(types)].pattern = None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 7  # a label only: every tensor has an override
    params.pure = True
    params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(override))
    if imatrix is not None:
        entry = llama_cpp.llama_model_imatrix_data
        items = [(n, imatrix.entries[n].values()) for n in types if n in imatrix.entries]
        im = (entry * (len(items) + 1))()
        for i, (name, values) in enumerate(items):
            key = name.encode()
            keep += [key, values]
            im[i].name = key
            im[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            im[i].size = values.size
        im[len(items)].name = None
        keep.append(im)
        params.imatrix = ctypes.cast(im, ctypes.POINTER(entry))
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src} (return code {rc})")


def tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    """GGUF name → (type, bytes) of every tensor in ``path``."""
    return {
        t.name: (t.tensor_type.name.lower(), np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors
    }
