"""The ONNX artifact's weights, written one decoder layer at a time from the checkpoint.

The model is built on ``meta`` and read as :mod:`moetool.compute.stream` reads it for a streamed evaluation
(transformers' own renames and conversions, cast to float32): first what lies outside the layer stack, then each
layer, whose export block (:meth:`ExportLM.block_of`) is computed, rounded as its :class:`~moetool.export.onnx.
layout.Stored` form says, appended to ``model.onnx.data`` and dropped before the next is read. Memory: the weights
outside the layers and one layer in float32, the fused experts of a sparse block, and one tensor being rounded.

Tensors of at least :data:`INLINE` bytes go to the data file, each at an offset aligned to :data:`ALIGN` (the page
size onnxruntime maps external data at); smaller ones stay in the graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch

from moetool.export.onnx.layout import INT4, Layout, Piece, Stored
from moetool.export.onnx.quantize import BLOCK

if TYPE_CHECKING:
    from onnx import ModelProto, TensorProto

    from moetool.export.onnx.structure import Structure

DATA_FILE = "model.onnx.data"
INLINE = 1024
ALIGN = 4096
_ITEM = {1: 4, 2: 1, 3: 1, 7: 8}  # onnx data type → bytes per element (INT4: half a byte, below)


def _nbits(w: np.ndarray, bits: int, block: int) -> list[np.ndarray]:
    """``w`` [N, K] for MatMulNBits, packed by onnxruntime's own kernel (what its MatMulNBitsQuantizer calls):
    (uint8 [N, K/block, block·bits/8], fp32 scales [N, K/block]), symmetric."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    n, k = w.shape
    blocks = -(-k // block)
    b = np.zeros((blocks * block, n), dtype=np.float32)  # [K, N], padded to whole blocks as the quantizer pads it
    b[:k] = w.T
    packed = np.zeros((n, blocks, block * bits // 8), dtype=np.uint8)
    scales = np.zeros((n, blocks), dtype=np.float32)
    zero_points = np.zeros((n, -(-blocks * bits // 8)), dtype=np.uint8)  # unused when symmetric
    kernel = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    kernel(packed, b, scales, zero_points, block, n, k, True)
    return [packed, scales]


def _gather4(w: np.ndarray, block: int) -> list[np.ndarray]:
    """A [V, D] table for GatherBlockQuantized at 4 bits (onnxruntime's quantizer's own numpy routine):
    (int4 pairs packed in uint8, fp32 scales [V, D/block])."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    packed, scales, _ = DefaultWeightOnlyQuantizer.quantize_ndarray(w, 1, block, True)
    return [packed, scales.astype(np.float32)]


def _experts(w: np.ndarray, bits: int, block: int | None) -> list[np.ndarray]:
    """Stacked experts [E, N, K] for QMoE, one expert at a time (the rounding's temporaries are one expert's)."""
    from moetool.export.onnx.moe_op import quantize_experts

    parts = [quantize_experts(w[e : e + 1], bits, block) for e in range(w.shape[0])]
    return [np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])]


def encode(stored: Stored, tensor: torch.Tensor) -> list[np.ndarray]:
    """The arrays of ``stored``'s pieces, in order, from its source ``tensor`` (float32)."""
    from moetool.export.onnx.quantize import int8_rows

    w = tensor.detach().float().numpy()
    if stored.form == "raw":
        return [w]
    if stored.form == "transposed":
        return [np.ascontiguousarray(w.T)]
    if stored.form == "nbits":
        return _nbits(w, stored.bits, stored.block or BLOCK)
    if stored.form == "gather4":
        return _gather4(w, stored.block or BLOCK)
    if stored.form == "gather8":
        q, scale = int8_rows(w)
        return [q, scale, np.array([w.shape[1]], dtype=np.int64)]
    if stored.form == "qmoe":
        return _experts(w, stored.bits, stored.block)
    raise ValueError(f"unknown stored form {stored.form!r}")


def _nbytes(piece: Piece) -> int:
    count = int(np.prod(piece.dims)) if piece.dims else 1
    return (count + 1) // 2 if piece.data_type == INT4 else count * _ITEM[piece.data_type]


class DataFile:
    """``model.onnx.data`` as it is appended to: each piece becomes a TensorProto that points into it (or holds its
    bytes, under :data:`INLINE`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: BinaryIO = path.open("wb")
        self.tensors: list[TensorProto] = []

    def add(self, piece: Piece, array: np.ndarray) -> None:
        from onnx import TensorProto

        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if len(data) != _nbytes(piece):
            raise RuntimeError(f"{piece.name}: {len(data)} bytes computed, {_nbytes(piece)} expected for {piece.dims}")
        t = TensorProto(name=piece.name, data_type=piece.data_type, dims=list(piece.dims))
        if len(data) < INLINE:
            t.raw_data = data.tobytes()
        else:
            at = self._f.tell()
            pad = -at % ALIGN
            self._f.write(b"\0" * pad)
            self._f.write(data.data)
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", self.path.name), ("offset", at + pad), ("length", len(data))):
                t.external_data.add(key=key, value=str(value))
        self.tensors.append(t)

    def close(self) -> None:
        self._f.close()


def _named(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + n: t for n, t in [*module.named_parameters(), *module.named_buffers()]}


def stream_sources(model_dir: Path, st: Structure) -> Iterator[dict[str, torch.Tensor]]:
    """The ExportLM tensors of ``model_dir``: first those outside the layer stack, then one decoder layer's at a
    time (its memory given back before the next is read), all in float32."""
    from moetool.export.graph.model import DenseMaskedMoE
    from moetool.export.graph.stream import streamed_export_model

    src = streamed_export_model(model_dir)
    yield {n: t for n, t in _named(src.em).items() if not n.startswith("layers.")}
    for i in range(st.n_layers):
        block = src.block(i)
        if st.sparse_layers and isinstance(block.mlp, DenseMaskedMoE):
            block.mlp.make_sparse()
        tensors = _named(block, f"layers.{i}.")
        yield tensors
        del tensors, block
        src.drop(i)


def write_weights(model_dir: Path, st: Structure, layout: Layout, data_path: Path) -> int:
    """Write every stored weight of ``layout`` into ``data_path`` and ``st.model``'s initializers; returns the bytes
    of the data file."""
    by_layer: dict[int | None, list[Stored]] = {}
    for s in layout.stored:
        by_layer.setdefault(s.layer, []).append(s)
    data = DataFile(data_path)
    try:
        for index, tensors in zip([None, *range(st.n_layers)], stream_sources(model_dir, st), strict=True):
            for stored in by_layer.get(index, []):
                if stored.source not in tensors:
                    raise RuntimeError(f"the export model has no tensor {stored.source} to store")
                for piece, array in zip(stored.pieces, encode(stored, tensors[stored.source]), strict=True):
                    data.add(piece, array)
    finally:
        data.close()
    st.model.graph.initializer.extend(data.tensors)
    return data_path.stat().st_size


def save_structure(model: ModelProto, path: Path) -> None:
    """Write the graph (its weights already in the data file beside it, :func:`write_weights`)."""
    import onnx

    onnx.save(model, str(path))
