"""The artifact's own weights as a transformers checkpoint: every GGUF tensor dequantized and mapped back.

Running transformers on these weights separates what the conversion does (names, layouts, permutations, the
runtime's arithmetic) from what the precision plan does (rounding the weights), so even a 4-bit file gets a
parity figure that must be small.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetool.export.gguf.layout import Layout


def unpermute_qk(a: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`moetool.export.gguf.names.permute_qk`."""
    return a.reshape(n_head, a.shape[0] // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _dequantize(rt: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A GGUF tensor as float32 in torch ``shape``: ggml's own row dequantizer for the block types (C, and the IQ
    types' grids that gguf-py's numpy port walks slowly), gguf-py for the float types."""
    import gguf

    kind = rt.tensor_type.name.lower()
    if kind in ("f32", "f16", "bf16"):
        return np.asarray(gguf.quants.dequantize(rt.data, rt.tensor_type), dtype=np.float32).reshape(shape)
    from moetool.export.gguf import ggml

    return ggml.dequantize(np.ascontiguousarray(rt.data).tobytes(), kind, shape)


def artifact_checkpoint(gguf_path: Path, model_dir: Path, layout: Layout, out: Path, dtype: str = "float32") -> Path:
    """Write ``out`` (config, tokenizer, model.safetensors) with the weights as llama.cpp will see them, in ``dtype``
    (the verification reference's)."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, list[tuple[int, np.ndarray]]] = {}  # split tensors' row slices, joined back below
    for t in layout.tensors:
        if t.zeros or not t.sources:
            continue
        if t.name == "output.weight" and t.sources == [
            s for x in layout.tensors if x.name == "token_embd.weight" for s in x.sources
        ]:
            continue  # the tied head duplicated for llama.cpp: transformers reads the embedding
        rt = by_name[t.name]
        arr = _dequantize(rt, t.shape)
        if t.permute_heads:
            arr = unpermute_qk(arr, t.permute_heads)
        if t.squeeze:
            arr = arr.reshape(1, -1)
        if t.rows is not None:
            slices.setdefault(t.sources[0], []).append((t.rows[0], arr))
        elif len(t.sources) > 1:
            for src, part in zip(t.sources, arr, strict=True):
                tensors[src] = torch.from_numpy(np.ascontiguousarray(part))
        else:
            tensors[t.sources[0]] = torch.from_numpy(np.ascontiguousarray(arr))
    for src, parts in slices.items():
        tensors[src] = torch.from_numpy(np.concatenate([a for _, a in sorted(parts, key=lambda p: p[0])], axis=-2))
    out.mkdir(parents=True, exist_ok=True)
    if dtype != "float32":
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja") and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    return out
