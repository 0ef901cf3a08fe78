"""A decoder layer's feed-forward block run a slice of positions at a time.

A feed-forward block (a dense MLP, or an MoE block: router, experts, shared expert) computes each position on its
own, so running it on a slice of the positions gives those positions' outputs. Its intermediates are the largest
activations of a layer: measured on one four-expert, top-2 layer of Mistral-7B's shape in float32, a forward
over 4,096 positions took 2.23 GB above the layer's weights, about 0.45 MB per position, most of it the experts'
``[positions, 14336]`` intermediates. Run :data:`FF_ROWS` positions at a time, they cost the same at any batch,
which lets a layer streamed from disk (:mod:`moetool.compute.stream`) run every window of an evaluation in one
read of the checkpoint without the activations of all of them at once.

While a block runs a slice, :func:`rows_of` gives the slice's first position and the positions in all, so a hook on
its router (:class:`moetool.routing.tap.RouterTap`) can put the pieces of one call back together.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetool.errors import MoetoolError

__all__ = ["FF_ROWS", "feed_forward", "rows_of", "run_in_rows"]

FF_ROWS = 1024  # positions a feed-forward block runs at once under run_in_rows
_ROWS = "_moetool_rows"  # the instance attribute holding (first position, positions in all) during a slice


def feed_forward(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's feed-forward block: ``mlp`` (the dense families, and Mixtral's and Qwen's MoEs in
    transformers 5) or ``block_sparse_moe`` (GraniteMoE); None when it has neither."""
    block = getattr(layer, "mlp", None)
    return block if block is not None else getattr(layer, "block_sparse_moe", None)


def rows_of(block: nn.Module) -> tuple[int, int] | None:
    """``(first, total)`` while ``block`` runs the slice of its input's flattened positions starting at ``first``
    out of ``total`` (:func:`run_in_rows`); None when it runs its whole input."""
    found = block.__dict__.get(_ROWS)
    return found if isinstance(found, tuple) else None


def run_in_rows(block: nn.Module, rows: int = FF_ROWS) -> None:
    """Make ``block`` (a feed-forward block: ``[B, T, H]`` in, ``[B, T, H]`` out, each position on its own) run its
    input ``rows`` positions at a time, as ``[1, rows, H]`` slices of the flattened positions, writing each slice's
    output into one ``[B, T, H]`` result. Other tensor inputs with the same leading ``[B, T]`` (a per-position route)
    are sliced alike; the rest pass as they are. An input of at most ``rows`` positions runs whole.

    Raises:
        MoetoolError: at run time, the block returns something other than one tensor of the input's positions.
    """
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    whole = block.forward

    def sliced(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        *lead, width = hidden_states.shape
        total = hidden_states.numel() // max(1, width)
        if total <= rows:
            out: torch.Tensor = whole(hidden_states, *args, **kwargs)
            return out
        flat = hidden_states.reshape(total, width)

        def cut(value: Any, first: int) -> Any:  # a per-position input ([*lead, ...], e.g. GEM's route) sliced too
            if isinstance(value, torch.Tensor) and tuple(value.shape[: len(lead)]) == tuple(lead):
                return value.reshape(total, *value.shape[len(lead) :])[first : first + rows].unsqueeze(0)
            return value

        result: torch.Tensor | None = None
        try:
            for first in range(0, total, rows):
                block.__dict__[_ROWS] = (first, total)
                part = whole(
                    flat[first : first + rows].unsqueeze(0),
                    *(cut(a, first) for a in args),
                    **{k: cut(v, first) for k, v in kwargs.items()},
                )
                n = min(rows, total - first)
                if not isinstance(part, torch.Tensor) or part.numel() % n:
                    raise MoetoolError(
                        f"{type(block).__name__} returned {type(part).__name__}, not one tensor of its {n} positions: "
                        "it cannot run a slice of positions at a time"
                    )
                part = part.reshape(n, -1)
                if result is None:
                    result = part.new_empty((total, part.shape[1]))
                result[first : first + n] = part
        finally:
            block.__dict__.pop(_ROWS, None)
        assert result is not None  # total > rows >= 1: the loop ran
        return result.view(*lead, -1)

    block.forward = sliced  # an instance attribute: nn.Module.__call__ runs it
