"""How a Core ML export is split into chunks, and the chain of converted wrappers run over parity calls.

A model whose decoder layers hold more than :data:`CHUNK_BYTES` of float32 weights is converted as several
``.mlpackage`` chunks of consecutive layers, each declaring the model-wide KV-cache states (:class:`~moetool.export.
coreml.stateful.StatefulChunk`): converting one chunk holds that chunk's layers several times over (coremltools'
copies), never the model. The chunks are then joined into one package (:mod:`moetool.export.coreml.join`), which runs
them in order, the hidden states of one the input of the next. Chunks are balanced: layer counts differ by at most
one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from moetool.export.graph.chunk import ChunkRunner, chain_calls

if TYPE_CHECKING:
    import numpy as np

    from moetool.export.graph.parity import Batch, Call
    from moetool.export.graph.stream import StreamedExport

__all__ = ["CHUNK_BYTES", "MODEL_FILE", "cache_bytes", "chunk_batch", "chunk_file"]

# decoder layers' float32 weights per package, by default: coremltools holds a chunk (and the embedding or head of
# the first and last) about five times over while it converts it; at 512 MiB the 360M-shaped rung peaked at 4.36 GB,
# twice its bf16 bytes
CHUNK_BYTES = 256 << 20


# the one package an export writes, whatever the number of chunks
MODEL_FILE = "model.mlpackage"


def chunk_file(index: int, count: int) -> str:
    """The package name of chunk ``index`` of ``count`` while it waits to be joined: :data:`MODEL_FILE` when the
    model is one chunk (converted straight to it)."""
    return MODEL_FILE if count == 1 else f"model_chunk{index:02d}.mlpackage"


def cache_bytes(config: dict[str, Any], capacity: int) -> int:
    """The float32 bytes of the two model-wide cache buffers every chunk's wrapper holds (all the layers, ``capacity``
    positions): the same in each chunk, so that the joined program declares each state once."""
    c = config.get("text_config") or config
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    return 2 * int(c["num_hidden_layers"]) * kv * capacity * head_dim * 4


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
                with torch.no_grad():  # the wrapper derives the positions from the mask, as the package does
                    return chunk(x, mask), []

            return run

        return open_chunk

    def run_all(calls: list[Call]) -> list[np.ndarray]:
        return chain_calls(calls, (opener(c, span) for c, span in enumerate(ranges)))

    return run_all
