"""How much memory evaluating a model takes, and whether it is held resident or streamed from disk layer by layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetool.compute.stream_bytes import streamed_weight_bytes
from moetool.eval.perplexity import NLL_ROWS
from moetool.io.budget import BudgetError, Need, available_memory, human

__all__ = ["MAX_STREAMED_BATCH", "Residency", "eval_need", "eval_residency"]


def _feed_forward_bytes(cfg: Mapping[str, Any]) -> int:
    """Bytes of a feed-forward block's intermediates per position, in float32: about four ``[positions, ff]``
    tensors per expert a position runs (gate and up, their activation, its product), and the shared expert's.
    Measured on a four-expert, top-2 layer of Mistral-7B's shape: 0.45 MB of the 0.55 MB per position a layer takes."""
    ff = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 4 * int(cfg["hidden_size"]))
    k = int(cfg.get("num_experts_per_tok") or 1)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return 16 * (ff * k + shared)


def _activations(cfg: Mapping[str, Any], tokens: int, width: int, ff_rows: int | None = None) -> int:
    """Bytes of one forward pass's activations over ``tokens`` positions: hidden states and attention per layer, the
    feed-forward block's intermediates over ``ff_rows`` positions (all of them when None: see
    :func:`moetool.compute.rows.run_in_rows`), the logits in the model's dtype (``width`` bytes, and 4 more for a
    float32 copy), and the loss's float32 copies of one slice of :data:`NLL_ROWS` positions (measured 22 bytes per
    logit, over the whole batch when the loss took it at once)."""
    vocab = int(cfg["vocab_size"])
    ff = min(tokens, ff_rows or tokens) * _feed_forward_bytes(cfg)
    return (
        tokens * int(cfg["hidden_size"]) * 24 + ff + tokens * vocab * (width + 4) + min(tokens, NLL_ROWS) * vocab * 20
    )


RUNTIME = 512 << 20  # the interpreter, torch and transformers themselves


def eval_need(path: Path, *, dtype: str | None, seq_len: int, batch_size: int = 8, streamed: bool = False) -> Need:
    """Peak memory of evaluating the model in ``path``: its weights in ``dtype`` and one batch of ``batch_size``
    windows (hidden states per layer, the logits and their float32 copy), plus a fixed runtime allowance.

    ``streamed``: the weights outside the layer stack and one decoder layer, in float32
    (:func:`moetool.compute.stream.streamed_weight_bytes`), instead of the whole model (:func:`load_causal_lm`).

    Raises:
        MoetoolError: an unknown dtype.
    """
    from moetool.compute.dtypes import resolve_dtype
    from moetool.compute.rows import FF_ROWS
    from moetool.compute.upcast import float32_overhead, native_matmul
    from moetool.io.checkpoint import Checkpoint

    ck = Checkpoint(Path(path))
    cfg = ck.config
    storage = resolve_dtype(dtype, Path(path))
    width = storage.itemsize
    params = sum(t.numel for t in ck.tensors.values())
    tokens = batch_size * seq_len
    if streamed:
        weights = streamed_weight_bytes(cfg, params, Path(path))
        acts = _activations(cfg, tokens, 4, FF_ROWS)
        held = f"weights {human(weights)} (outside the layers, and one layer read in float32)"
    else:
        weights = params * width
        if not native_matmul(storage, torch.device("cpu")):  # float32 arithmetic over 16-bit weights (load_causal_lm)
            weights += float32_overhead(params, cfg)
        acts = _activations(cfg, tokens, width)
        held = f"weights {human(weights)}"
    return Need(
        stage=f"evaluating {path}",
        memory=weights + acts + RUNTIME,
        memory_detail=f"{held}, activations {human(acts)} for {batch_size} windows of {seq_len}",
        way_out="Evaluate in bfloat16 (--dtype bfloat16), use a GPU (--device cuda), a shorter --seq-len, or another "
        "machine",
    )


@dataclass(frozen=True)
class Residency:
    """How a model is held while it is evaluated: resident, or streamed from disk one layer at a time (with how many
    windows each forward pass runs, since each pass reads the whole checkpoint, and why)."""

    streamed: bool
    batch_size: int
    reason: str = ""


MAX_STREAMED_BATCH = 64  # windows per streamed pass; beyond it the read of the weights is no longer what costs


def eval_residency(path: Path, *, dtype: str | None, seq_len: int, batch_size: int = 8) -> Residency:
    """Resident when the model fits the memory available (:func:`moetool.io.budget.available_memory`), else streamed
    from disk layer by layer with as many windows per pass as fit (up to :data:`MAX_STREAMED_BATCH`).

    Raises:
        BudgetError: neither fits, naming both needs.
    """
    resident = eval_need(path, dtype=dtype, seq_len=seq_len, batch_size=batch_size)
    try:
        resident.check()
        return Residency(streamed=False, batch_size=batch_size)
    except BudgetError as exc:
        refused = exc
    one = eval_need(path, dtype=dtype, seq_len=seq_len, batch_size=1, streamed=True)
    mem = available_memory()
    if mem is None or one.memory > mem:
        raise BudgetError(
            f"{refused} Streamed from disk one layer at a time it would still need about {human(one.memory)} "
            f"({one.memory_detail})."
        ) from None
    # the largest batch that fits, searched: the need is not linear in the windows (the loss's slice and the
    # feed-forward block's rows stop growing), so the step from one window to two would undercount them
    batch, over = 1, MAX_STREAMED_BATCH + 1
    while over - batch > 1:
        mid = (batch + over) // 2
        if eval_need(path, dtype=dtype, seq_len=seq_len, batch_size=mid, streamed=True).memory <= mem:
            batch = mid
        else:
            over = mid
    return Residency(
        streamed=True,
        batch_size=batch,
        reason=f"the resident model needs about {human(resident.memory)} of the {human(mem)} available: its layers "
        f"are read from disk as each runs ({human(one.memory)} at one window, {batch} windows per pass)",
    )
