"""The artifact's own weights as a transformers checkpoint: every GGUF tensor dequantized and mapped back.

Running transformers on these weights separates what the conversion does (names, layouts, permutations, the
runtime's arithmetic) from what the precision plan does (rounding the weights), so even a 4-bit file gets a
parity figure that must be small.
"""

from __future__ import annotations

import math
import shutil
import threading
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


def _dequantize(rt: ReaderTensor, shape: tuple[int, ...], index: int | None = None) -> np.ndarray:
    """A GGUF tensor (or its ``index``-th along its outermost dimension, an expert of a stack) as float32 in torch
    ``shape``: ggml's own row dequantizer for the block types (C, and the IQ types' grids that gguf-py's numpy port
    walks slowly), gguf-py for the float types."""
    import gguf

    kind = rt.tensor_type.name.lower()
    data = rt.data if index is None else rt.data[index]  # [E, rows, row bytes]: one expert's rows
    if kind in ("f32", "f16", "bf16"):
        return np.asarray(gguf.quants.dequantize(data, rt.tensor_type), dtype=np.float32).reshape(shape)
    from moetool.export.gguf import ggml

    return ggml.dequantize(np.ascontiguousarray(data).tobytes(), kind, shape)


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


_PIECE = 1 << 22  # elements summed at once: float64 copies of a whole expert were 0.7 GB at Mistral-7B's shape


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """``||got - want|| / ||want||`` in float64, summed a piece at a time; 0 when both are equal, inf for a nonzero
    ``got`` of a zero ``want``."""
    g, w = got.reshape(-1), want.reshape(-1)
    diff = norm = 0.0
    for s in range(0, w.size, _PIECE):
        want64 = w[s : s + _PIECE].astype(np.float64)
        delta = g[s : s + _PIECE].astype(np.float64) - want64
        diff += float(delta @ delta)
        norm += float(want64 @ want64)
    if diff == 0.0:
        return 0.0
    return math.sqrt(diff / norm) if norm > 0 else float("inf")


class ArtifactTensors:
    """The artifact's weights as llama.cpp will see them, under the source checkpoint's names, dequantized one source
    tensor at a time when asked (:meth:`get`); each is compared with the source tensor the first time it is made,
    into ``rounding`` (as :class:`ArtifactWeights`). An expert of a stacked tensor is dequantized alone (the whole
    stack in float32 was 0.94 GB at Mistral-7B's shape, beside the layer being built).

    It serves as a streamed model's tensor source (``keys`` and ``get_slice``, as a safetensors handle:
    :class:`moetool.compute.stream.CheckpointLoader`), so a model larger than memory is verified without a copy of
    its dequantized weights on disk.
    """

    def __init__(self, gguf_path: Path, model_dir: Path, layout: Layout) -> None:
        import gguf

        from moetool.io.checkpoint import Checkpoint

        self._by_name = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
        tied = [s for x in layout.tensors if x.name == "token_embd.weight" for s in x.sources]
        wanted = [
            t
            for t in layout.tensors
            if not t.zeros and t.sources and not (t.name == "output.weight" and t.sources == tied)
        ]  # the tied head is duplicated for llama.cpp only: transformers reads the embedding
        self._parts: dict[str, list[GGUFTensor]] = {}  # a source split along its rows into several GGUF tensors
        self._of: dict[str, GGUFTensor | None] = {}  # source → its GGUF tensor, or None for a split source
        for t in wanted:
            if t.rows is not None:
                self._of.setdefault(t.sources[0], None)
                self._parts.setdefault(t.sources[0], []).append(t)
            else:
                self._of.update((src, t) for src in t.sources)
        self._ckpt = Checkpoint(model_dir)
        self.rounding: dict[str, tuple[str, float, float | None]] = {}
        self._lock = threading.Lock()

    def keys(self) -> list[str]:
        """The source names, in the order the GGUF holds them."""
        return list(self._of)

    def shape(self, src: str) -> tuple[int, ...]:
        return tuple(self._ckpt.tensors[src].shape)

    def get(self, src: str) -> np.ndarray:
        """Source tensor ``src`` as the artifact holds it, float32 in the source's shape. One call at a time (the
        source checkpoint's reads share a file position), though a loader may ask from several threads."""
        with self._lock:
            return self._get(src)

    def _get(self, src: str) -> np.ndarray:
        g = self._of[src]
        if g is None:
            pieces = sorted(self._parts[src], key=lambda p: p.rows[0] if p.rows else 0)
            arr = np.concatenate([_array(self._by_name, p) for p in pieces], axis=-2)
            kind = max((self._by_name[p.name].tensor_type.name.lower() for p in pieces), key=_coarseness)
        elif len(g.sources) > 1:  # a stack of experts, [E, ...] (never head-permuted nor squeezed)
            arr = _dequantize(self._by_name[g.name], g.shape[1:], g.sources.index(src))
            kind = self._by_name[g.name].tensor_type.name.lower()
        else:
            arr = _array(self._by_name, g)
            kind = self._by_name[g.name].tensor_type.name.lower()
        # a copy only where needed (a read-only view of the mapped file): a streamed model copies it into place
        got = np.require(arr, np.float32, ["C", "W"]).reshape(self.shape(src))
        if src not in self.rounding:  # the source is read once, the first time (a streamed model asks every pass)
            want = self._ckpt.get(src).float().numpy()
            self.rounding[src] = (kind, relative_error(got, want), off_rounding(got, want, kind))
        return got

    def get_slice(self, src: str) -> _Lazy:
        return _Lazy(self, src)

    def close(self) -> None:
        self._ckpt.close()


class _Lazy:
    """One tensor of :class:`ArtifactTensors` in a safetensors slice's shape: made when indexed (``[...]``)."""

    def __init__(self, owner: ArtifactTensors, src: str) -> None:
        self._owner, self._src = owner, src

    def get_shape(self) -> list[int]:
        return list(self._owner.shape(self._src))

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, _key: object) -> torch.Tensor:
        return torch.from_numpy(self._owner.get(self._src))


def artifact_checkpoint(
    gguf_path: Path, model_dir: Path, layout: Layout, out: Path, dtype: str = "float32"
) -> ArtifactWeights:
    """Write ``out`` (config, tokenizer, model.safetensors) with the weights as llama.cpp will see them, in ``dtype``
    (the verification reference's), one tensor at a time: memory holds one tensor, not the model; each is compared
    with the source tensor as it goes (:class:`ArtifactWeights`)."""
    from moetool.io.writer import ShardedWriter

    tensors = ArtifactTensors(gguf_path, model_dir, layout)
    torch_dtype = getattr(torch, dtype)
    out.mkdir(parents=True, exist_ok=True)
    names = tensors.keys()
    with ShardedWriter(out, [(k, torch_dtype, tensors.shape(k)) for k in names], 2**62) as writer:
        for src in names:
            writer.add(src, torch.from_numpy(tensors.get(src)).to(torch_dtype))
    tensors.close()
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja") and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    return ArtifactWeights(out, tensors.rounding)


def _coarseness(kind: str) -> int:
    """Rank of a GGUF type by the rounding it allows (a split source is judged by its coarsest piece)."""
    return [name for name, _ in FAMILIES].index(family_of({kind}))
