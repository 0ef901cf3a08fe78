"""Some consecutive decoder layers of an ExportLM as a model of their own, and the parity calls run through a chain of
such chunks one chunk at a time: how the graph targets that convert a few layers at a time (Core ML, ExecuTorch,
TFLite) build and check an artifact of several programs; :func:`chain_step` runs one call through all of them loaded,
as an app does.

A chunk's first input is ``input_ids [B, T]`` for the first chunk (it embeds them), the previous chunk's hidden
states ``[B, T, D]`` otherwise; its first output is ``logits [B, T, V]`` for the last chunk (final norm and head),
hidden states otherwise. The parameters keep the ExportLM's names (``layers.5.attn.q.weight``), so the plan's
precisions read the same whichever chunk holds a layer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moetool.export.base import ExportError

if TYPE_CHECKING:
    import numpy as np

    from moetool.export.base import ExportRequest
    from moetool.export.graph.common import GraphPlan
    from moetool.export.graph.model import Block, ExportLM
    from moetool.export.graph.parity import Call

__all__ = [
    "ChunkRunner",
    "ExportChunk",
    "chain_calls",
    "chain_step",
    "chunk_layers",
    "chunk_ranges",
    "count_option",
    "end_bytes",
    "planned_chunks",
]


def chunk_ranges(
    n_layers: int, layer_bytes: int, chunk_bytes: int, chunk_layers: int | None = None, end_bytes: int = 0
) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk's layers: ``chunk_layers`` per chunk at most, balanced (counts differ by at
    most one); None: as many ``layer_bytes`` layers as ``chunk_bytes`` holds (at least one), where the first and last
    chunks also convert ``end_bytes`` each (the embedding, the head), so they take fewer layers and the middle ones
    are balanced. A model whose layers, embedding and head fit ``chunk_bytes`` together is one chunk.

    Raises:
        ExportError: ``chunk_layers`` below 1.
    """
    if chunk_layers is not None and chunk_layers < 1:
        raise ExportError(f"--chunk-layers {chunk_layers}: a chunk holds at least one decoder layer")
    per = chunk_layers or max(1, chunk_bytes // max(1, layer_bytes))
    at_ends = max(1, min(per, (chunk_bytes - end_bytes) // max(1, layer_bytes)))
    if chunk_layers is not None or at_ends == per or n_layers * layer_bytes + 2 * end_bytes <= chunk_bytes:
        return _balanced(0, n_layers, per)
    if n_layers <= 2 * at_ends:
        return _balanced(0, n_layers, math.ceil(n_layers / 2))
    middle = _balanced(at_ends, n_layers - at_ends, per)
    return [(0, at_ends), *middle, (n_layers - at_ends, n_layers)]


def _balanced(start: int, stop: int, per: int) -> list[tuple[int, int]]:
    """``[start, stop)`` in as few chunks of at most ``per`` as it takes, their sizes differing by at most one."""
    n = stop - start
    if n <= 0:
        return []
    count = math.ceil(n / per)
    return list(itertools.pairwise(start + round(i * n / count) for i in range(count + 1)))


def end_bytes(config: dict[str, Any], params: int) -> int:
    """Float32 bytes the first chunk converts beside its layers (the embedding), and the last (the head): the
    weights outside the layer stack, halved when the head is a tensor of its own (:func:`layer_bytes`)."""
    from moetool.compute.upcast import layer_bytes

    outside, _ = layer_bytes(config, params)
    c = config.get("text_config") or config
    return outside if c.get("tie_word_embeddings", True) else outside // 2


def count_option(req: ExportRequest, key: str, flag: str, why: str) -> int | None:
    """The count exporter option ``key`` gives (``flag`` on the command line; None: not given).

    Raises:
        ExportError: ``"{flag} N: {why}"`` when it is below 1.
    """
    given = req.options.get(key)
    if given is None:
        return None
    if int(given) < 1:
        raise ExportError(f"{flag} {given}: {why}")
    return int(given)


def chunk_layers(req: ExportRequest) -> int | None:
    """``--chunk-layers`` (None: not given).

    Raises:
        ExportError: below 1.
    """
    return count_option(req, "chunk_layers", "--chunk-layers", "a chunk holds at least one decoder layer")


def planned_chunks(req: ExportRequest, plan: GraphPlan, chunk_bytes: int) -> list[tuple[int, int]]:
    """The chunks of ``plan``'s model: ``--chunk-layers`` per chunk, else as many layers as ``chunk_bytes`` of their
    float32 weights hold, with the embedding and head counted in the first and last (:func:`chunk_ranges`).

    Raises:
        ExportError: ``--chunk-layers`` below 1.
    """
    from moetool.compute.upcast import layer_bytes

    params = plan.quant.total_params
    _, layer = layer_bytes(plan.config, params)
    end = end_bytes(plan.config, params)
    return chunk_ranges(int(plan.config["num_hidden_layers"]), layer, chunk_bytes, chunk_layers(req), end)


class ExportChunk(nn.Module):
    """``forward(x, position_ids, mask, *past) -> (y, *present)`` over layers ``blocks`` of ``em``, the KV cache as
    explicit inputs and outputs as in :class:`ExportLM` (``past``: ``k_i, v_i`` per layer of the chunk, or empty for a
    prefill). One chunk of every layer computes what the ExportLM does."""

    def __init__(self, em: ExportLM, blocks: Mapping[int, Block], *, first: bool = True, last: bool = True) -> None:
        super().__init__()
        self.embed = em.embed if first else None
        self.layers = nn.ModuleDict({str(i): b for i, b in blocks.items()})
        self.norm = em.norm if last else None
        self.lm_head = em.lm_head if last else None
        self.rope = em.rope
        self.first, self.last = first, last
        self.n_layers, self.n_kv, self.head_dim = len(blocks), em.n_kv, em.head_dim
        self.hidden_size = int(em.embed.weight.shape[1])

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        if self.embed is not None:
            x = self.embed(x)
        cos, sin = self.rope(position_ids, x.dtype)
        present: list[torch.Tensor] = []
        for j, block in enumerate(self.layers.values()):
            pk = past[2 * j] if past else None
            pv = past[2 * j + 1] if past else None
            x, k, v = block(x, cos, sin, mask, pk, pv)
            present += [k, v]
        if self.lm_head is not None and self.norm is not None:
            x = self.lm_head(self.norm(x))
        return (x, *present)


# one chunk in its runtime: (x, position_ids [1, T], mask, past) → (y, present); past None is a prefill from an
# empty cache (a runtime that keeps its cache as state resets it then, and returns no present)
ChunkRunner = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor] | None], tuple[torch.Tensor, list[torch.Tensor]]
]


def chain_calls(calls: list[Call], chunks: Iterable[Callable[[], ChunkRunner]]) -> list[np.ndarray]:
    """Every call's logits through a chain of chunks, one chunk at a time: each chunk (opened by its factory, which
    may read its weights or load its program) runs over all the calls, its cache carried from a call to the decode
    calls after it and emptied at each prefill, and its outputs are the next chunk's inputs. The calls are known up
    front (teacher-forced decode), so no chunk is opened twice."""
    from moetool.compute.stream import give_back_freed_memory
    from moetool.export.graph.model import causal_mask

    xs: list[torch.Tensor] = [torch.from_numpy(ids) for ids, _ in calls]
    for open_chunk in chunks:
        run = open_chunk()
        past: list[torch.Tensor] = []
        for j, (ids, pos) in enumerate(calls):
            t, start = ids.shape[1], pos or 0
            given = None if pos is None else past  # a prefill starts a new sequence from an empty cache
            xs[j], past = run(xs[j], torch.arange(start, start + t)[None], causal_mask(t, start), given)
        del run  # the chunk's weights or program with it
        give_back_freed_memory()
    return [x.numpy() for x in xs]


def chain_step(
    runners: list[ChunkRunner], ids: torch.Tensor, start: int, pasts: list[list[torch.Tensor]] | None
) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """One call through every chunk of a chain, all loaded (what an app serving the artifact does per step):
    ``ids [1, T]`` at positions ``start …``, each chunk with its own cache (``pasts[i]``; None: a prefill from empty
    caches). Returns the last chunk's logits ``[1, T, V]`` and every chunk's new cache."""
    from moetool.export.graph.model import causal_mask

    t = ids.shape[1]
    pos, mask = torch.arange(start, start + t)[None], causal_mask(t, start)
    x, caches = ids, []
    for i, run in enumerate(runners):
        x, past = run(x, pos, mask, None if pasts is None else pasts[i])
        caches.append(past)
    return x, caches
