"""How a Core ML export is split into packages, and the chain of converted wrappers run over parity calls.

A model whose decoder layers hold more than :data:`CHUNK_BYTES` of float32 weights is converted as several
``.mlpackage`` chunks of consecutive layers, each with its own KV-cache states (:class:`~moetool.export.coreml.
stateful.StatefulChunk`): converting one chunk holds that chunk's layers several times over (coremltools' copies),
never the model. The app runs the chunks in order, the hidden states of one the input of the next. Chunks are
balanced: layer counts differ by at most one.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from moetool.export.base import ExportError
from moetool.export.graph.model import causal_mask

if TYPE_CHECKING:
    from moetool.export.graph.parity import Batch, Call
    from moetool.export.graph.stream import StreamedExport

__all__ = ["CHUNK_BYTES", "chunk_batch", "chunk_file", "chunk_ranges"]

# decoder layers' float32 weights per package, by default: coremltools holds a chunk about five times over while it
# converts it, so this bounds the conversion near 2.5 GB whatever the model's size
CHUNK_BYTES = 512 << 20


def chunk_ranges(n_layers: int, layer_bytes: int, chunk_layers: int | None = None) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk's layers: ``chunk_layers`` per chunk at most (None: as many as
    :data:`CHUNK_BYTES` of float32 layers hold, at least one), balanced.

    Raises:
        ExportError: ``chunk_layers`` below 1.
    """
    if chunk_layers is not None and chunk_layers < 1:
        raise ExportError(f"--chunk-layers {chunk_layers}: a chunk holds at least one decoder layer")
    per = chunk_layers or max(1, CHUNK_BYTES // max(1, layer_bytes))
    count = math.ceil(n_layers / per)
    bounds = [round(i * n_layers / count) for i in range(count + 1)]
    return list(itertools.pairwise(bounds))


def chunk_file(index: int, count: int) -> str:
    """The package name of chunk ``index`` of ``count``: ``model.mlpackage`` when the model is one chunk."""
    return "model.mlpackage" if count == 1 else f"model_chunk{index:02d}.mlpackage"


def chunk_batch(src: StreamedExport, ranges: list[tuple[int, int]], capacity: int) -> Batch:
    """Every parity call through the chain of :class:`StatefulChunk` wrappers that was converted, one chunk at a time:
    each chunk's layers are read from the checkpoint once and run over all the calls (its cache reset at each
    prefill), their hidden states kept for the next chunk. Memory: one chunk's float32 layers and the calls' hidden
    states."""
    from moetool.export.coreml.stateful import StatefulChunk

    def run(calls: list[Call]) -> list[np.ndarray]:
        xs: list[torch.Tensor] = [torch.from_numpy(ids) for ids, _ in calls]
        for c, (start, stop) in enumerate(ranges):
            blocks = {i: src.block(i) for i in range(start, stop)}
            chunk = StatefulChunk(src.em, blocks, capacity, first=c == 0, last=c == len(ranges) - 1).eval()
            with torch.no_grad():
                for j, (ids, pos) in enumerate(calls):
                    if pos is None:  # a new sequence: an empty cache
                        chunk.reset()
                    t, past = ids.shape[1], pos or 0
                    xs[j] = chunk(xs[j], torch.arange(past, past + t)[None], causal_mask(t, past))
            del chunk, blocks
            for i in range(start, stop):
                src.drop(i)
        return [x.numpy() for x in xs]

    return run
