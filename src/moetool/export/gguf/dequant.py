"""The artifact's own weights as a transformers checkpoint: every GGUF tensor dequantized and mapped back.

Running transformers on these weights separates what the conversion does (names, layouts, permutations, the
runtime's arithmetic) from what the precision plan does (rounding the weights), so even a 4-bit file gets a
parity figure that must be small.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from moetool.export.gate import FAMILIES, family_of
from moetool.export.gguf.layout import GGUFTensor, Layout

if TYPE_CHECKING:
    from gguf import ReaderTensor


def unpermute_qk(a: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`moetool.export.gguf.names.permute_qk`."""
    return a.reshape(n_head, a.shape[0] // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _dequantize(rt: ReaderTensor, shape: tuple[int, ...]) -> np.ndarray:
    """A GGUF tensor as float32 in torch ``shape``: ggml's own row dequantizer for the block types (C, and the IQ
    types' grids that gguf-py's numpy port walks slowly), gguf-py for the float types."""
    import gguf

    kind = rt.tensor_type.name.lower()
    if kind in ("f32", "f16", "bf16"):
        return np.asarray(gguf.quants.dequantize(rt.data, rt.tensor_type), dtype=np.float32).reshape(shape)
    from moetool.export.gguf import ggml

    return ggml.dequantize(np.ascontiguousarray(rt.data).tobytes(), kind, shape)


def _array(by_name: dict[str, ReaderTensor], t: GGUFTensor) -> np.ndarray:
    arr = _dequantize(by_name[t.name], t.shape)
    if t.permute_heads:
        arr = unpermute_qk(arr, t.permute_heads)
    return arr.reshape(1, -1) if t.squeeze else arr


@dataclass
class ArtifactWeights:
    """The artifact's dequantized weights as a checkpoint (``path``) and, per source tensor, the GGUF type it was
    stored in, its relative error against the source, ``||dequantized - source|| / ||source||``, and, for the types
    gguf-py rounds as llama.cpp does (:data:`REPRODUCIBLE`), its distance from the source rounded here, relative to
    the source (``rounding``, which :func:`moetool.export.gate.margin_gate` holds to what the type's rounding can
    do)."""

    path: Path
    rounding: dict[str, tuple[str, float, float | None]] = field(default_factory=dict)


# types whose rounding gguf-py reproduces (round to nearest on a block's absmax): the file's tensor must be the
# source's rounded, up to ties rounded the other way by llama.cpp's quantizer
REPRODUCIBLE = frozenset({"f16", "bf16", "q8_0"})


def off_rounding(got: np.ndarray, want: np.ndarray, kind: str) -> float | None:
    """``||got - round(want)|| / ||round(want)||`` for a :data:`REPRODUCIBLE` ``kind`` (None for the others, or when the
    rows do not fall into its blocks)."""
    import gguf

    if kind not in REPRODUCIBLE or not want.size:
        return None
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    rows = want.reshape(-1, want.shape[-1]).astype(np.float32)
    if rows.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return None
    rounded = np.asarray(gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype), dtype=np.float32)
    return relative_error(got.reshape(rounded.shape), rounded)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """``||got - want|| / ||want||`` in float64; 0 when both are equal, inf for a nonzero ``got`` of a zero ``want``."""
    diff = float(np.linalg.norm((got.astype(np.float64) - want.astype(np.float64)).ravel()))
    if diff == 0.0:
        return 0.0
    norm = float(np.linalg.norm(want.astype(np.float64).ravel()))
    return diff / norm if norm > 0 else float("inf")


def artifact_checkpoint(
    gguf_path: Path, model_dir: Path, layout: Layout, out: Path, dtype: str = "float32"
) -> ArtifactWeights:
    """Write ``out`` (config, tokenizer, model.safetensors) with the weights as llama.cpp will see them, in ``dtype``
    (the verification reference's), one tensor at a time: memory holds one tensor, not the model; each is compared
    with the source tensor as it goes (:class:`ArtifactWeights`)."""
    import gguf

    from moetool.io.checkpoint import Checkpoint
    from moetool.io.writer import ShardedWriter

    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    tied = [s for x in layout.tensors if x.name == "token_embd.weight" for s in x.sources]
    wanted = [
        t for t in layout.tensors if not t.zeros and t.sources and not (t.name == "output.weight" and t.sources == tied)
    ]  # the tied head is duplicated for llama.cpp only: transformers reads the embedding
    parts: dict[str, list[GGUFTensor]] = {}  # a source split along its rows into several GGUF tensors
    steps: list[tuple[str, GGUFTensor | None]] = []  # (source, its GGUF tensor) or (split source, None)
    for t in wanted:
        if t.rows is not None:
            if t.sources[0] not in parts:
                steps.append((t.sources[0], None))
            parts.setdefault(t.sources[0], []).append(t)
        else:
            steps += [(src, t) for src in t.sources]
    ckpt = Checkpoint(model_dir)
    torch_dtype = getattr(torch, dtype)
    entries = [(src, torch_dtype, tuple(ckpt.tensors[src].shape)) for src, _ in steps]
    out.mkdir(parents=True, exist_ok=True)
    result = ArtifactWeights(out)
    stacked: tuple[str, np.ndarray] | None = None  # a stacked expert tensor, read once for its experts
    with ShardedWriter(out, entries, 2**62) as writer:
        for src, g in steps:
            if g is None:
                pieces = sorted(parts[src], key=lambda p: p.rows[0] if p.rows else 0)
                arr = np.concatenate([_array(by_name, p) for p in pieces], axis=-2)
                kind = max((by_name[p.name].tensor_type.name.lower() for p in pieces), key=_coarseness)
            elif len(g.sources) > 1:
                if stacked is None or stacked[0] != g.name:
                    stacked = (g.name, _array(by_name, g))
                arr = stacked[1][g.sources.index(src)]
                kind = by_name[g.name].tensor_type.name.lower()
            else:
                arr = _array(by_name, g)
                kind = by_name[g.name].tensor_type.name.lower()
            want = ckpt.get(src).float().numpy()
            got = np.asarray(arr, dtype=np.float32).reshape(want.shape)
            result.rounding[src] = (kind, relative_error(got, want), off_rounding(got, want, kind))
            writer.add(src, torch.from_numpy(np.array(arr, dtype=np.float32)).to(torch_dtype))
    ckpt.close()
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja") and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    return result


def _coarseness(kind: str) -> int:
    """Rank of a GGUF type by the rounding it allows (a split source is judged by its coarsest piece)."""
    return [name for name, _ in FAMILIES].index(family_of({kind}))
