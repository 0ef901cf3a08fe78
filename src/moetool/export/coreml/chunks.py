"""How a Core ML export is split into packages, and the chain of converted wrappers run over parity calls.

A model whose decoder layers hold more than :data:`CHUNK_BYTES` of float32 weights is converted as several
``.mlpackage`` chunks of consecutive layers, each with its own KV-cache states (:class:`~moetool.export.coreml.
stateful.StatefulChunk`): converting one chunk holds that chunk's layers several times over (coremltools' copies),
never the model. The app runs the chunks in order, the hidden states of one the input of the next. Chunks are
balanced: layer counts differ by at most one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from moetool.export.graph.chunk import ChunkRunner, chain_calls

if TYPE_CHECKING:
    import numpy as np

    from moetool.export.graph.parity import Batch, Call
    from moetool.export.graph.stream import StreamedExport

__all__ = ["CHUNK_BYTES", "chunk_batch", "chunk_file"]

# decoder layers' float32 weights per package, by default: coremltools holds a chunk (and the embedding or head of
# the first and last) about five times over while it converts it; at 512 MiB the 360M-shaped rung peaked at 4.36 GB,
# twice its bf16 bytes
CHUNK_BYTES = 256 << 20


def chunk_file(index: int, count: int) -> str:
    """The package name of chunk ``index`` of ``count``: ``model.mlpackage`` when the model is one chunk."""
    return "model.mlpackage" if count == 1 else f"model_chunk{index:02d}.mlpackage"


def chunk_batch(src: StreamedExport, ranges: list[tuple[int, int]], capacity: int) -> Batch:
    """Every parity call through the chain of :class:`StatefulChunk` wrappers that was converted, one chunk at a time
    (:func:`moetool.export.graph.chunk.chain_calls`): each chunk's layers are read from the checkpoint once more and
    run over all the calls. Memory: one chunk's float32 layers and the calls' hidden states."""
    from moetool.export.coreml.stateful import StatefulChunk

    def opener(c: int, span: tuple[int, int]) -> Callable[[], ChunkRunner]:
        def open_chunk() -> ChunkRunner:
            blocks = {i: src.block(i) for i in range(*span)}
            chunk = StatefulChunk(src.em, blocks, capacity, first=c == 0, last=c == len(ranges) - 1).eval()
            for i in range(*span):  # the wrapper holds the blocks' weights now; the transformers layers can go
                src.drop(i)

            def run(
                x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, past: list[torch.Tensor] | None
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
                if past is None:  # the cache is the wrapper's state: emptied for a new sequence
                    chunk.reset()
                with torch.no_grad():
                    return chunk(x, pos, mask), []

            return run

        return open_chunk

    def run_all(calls: list[Call]) -> list[np.ndarray]:
        return chain_calls(calls, (opener(c, span) for c, span in enumerate(ranges)))

    return run_all
