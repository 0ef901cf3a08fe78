"""Parity of a graph artifact in its runtime against transformers (fp32): two prefill lengths, a decode run with
the KV cache, and top-1 agreement and perplexity on held-out windows."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from moetool.export.base import ExportError
from moetool.export.graph.model import prefill_inputs
from moetool.export.heldout import agreement_of, reference_logits, windows
from moetool.export.parity import DecodeCheck, ParityRecord
from moetool.io.jsontypes import JsonObject

Prefill = Callable[[np.ndarray], tuple[np.ndarray, list[np.ndarray]]]  # ids [1, T] → (logits, present)
Decode = Callable[[np.ndarray, int, list[np.ndarray]], tuple[np.ndarray, list[np.ndarray]]]  # (ids [1,1], pos, past)
# (ids [1, T], None) is a prefill from an empty cache; (ids [1, 1], pos) decodes the token at ``pos`` after the call
# before it. A Batch gives every call's logits [1, T, V], in order: a runtime that must see the calls up front (a
# model converted in chunks, checked chunk by chunk as each is converted) takes them at once
Call = tuple[np.ndarray, int | None]
Batch = Callable[[list[Call]], list[np.ndarray]]


def sequential(prefill: Prefill, decode: Decode | None) -> Batch:
    """The calls run one after another through ``prefill`` and ``decode``, the cache carried between them."""

    def run(calls: list[Call]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        past: list[np.ndarray] = []
        for ids, pos in calls:
            if pos is None:
                logits, past = prefill(ids)
            elif decode is None:
                raise ValueError("a decode call without a decode function")
            else:
                logits, past = decode(ids, pos, past)
            out.append(logits)
        return out

    return run


def measure_graph(
    hf: nn.Module,
    export_model: nn.Module | None,
    tok: PreTrainedTokenizerBase,
    text: str,
    prefill: Prefill | None,
    decode: Decode | None,
    *,
    runtime: str,
    seq_lens: tuple[int, ...] = (32, 128),
    n_windows: int = 4,
    decode_steps: int = 8,
    reference: str = "transformers float32",
    batch: Batch | None = None,
) -> ParityRecord:
    """The artifact's figures (its ``prefill``/``decode`` in its runtime) against transformers ``hf`` on ``text``:
    max |Δlogit| per length in ``seq_lens`` (capped at the model's positions), the cached decode's over
    ``decode_steps`` tokens, top-1 and perplexity over ``n_windows`` windows. ``export_model`` (the torch wrapper
    that was converted) is compared too, so a mismatch can be told apart from the conversion's; None for a graph
    built without one (a streamed export). ``reference`` names ``hf`` in the record. ``batch`` (instead of
    ``prefill`` and ``decode``) runs every call at once (:data:`Batch`), the cached decode included.

    ``hf`` runs once over every window (:func:`reference_logits`: one pass, for a model streamed from disk)."""

    max_pos = int(getattr(hf.config, "max_position_embeddings", 2048))
    lens = sorted({min(n, max_pos) for n in seq_lens})
    probes, ppl_windows = windows(tok, text, lens, n_windows)
    calls: list[Call] = [(np.array([ids], dtype=np.int64), None) for ids in probes + ppl_windows]
    decoding = decode is not None or batch is not None
    n0 = len(probes[-1]) - decode_steps
    if decoding:  # a prefill of the last probe's start, then its last tokens one at a time against the cache
        calls.append((np.array([probes[-1][:n0]], dtype=np.int64), None))
        calls += [(np.array([[probes[-1][t]]], dtype=np.int64), t) for t in range(n0, len(probes[-1]))]
    if batch is None:
        if prefill is None:
            raise ValueError("measure_graph needs a prefill function or a batch runner")
        batch = sequential(prefill, decode)
    outs = batch(calls)
    got = [o[0] for o in outs[: len(probes) + len(ppl_windows)]]
    ref = reference_logits(hf, probes + ppl_windows)
    vs = agreement_of(got, ref, probes, ppl_windows)
    wrapper: dict[str, float] = {}
    for ids, want in zip(probes, ref, strict=False):
        if export_model is None:
            break
        with torch.no_grad():
            ours = export_model(*prefill_inputs(torch.tensor([ids])))[0][0].numpy()
        wrapper[str(len(ids))] = float(np.abs(want - ours).max())
    checked = None
    if decoding:
        want = ref[len(probes) - 1]
        rest = outs[len(probes) + len(ppl_windows) :]
        worst = float(np.abs(rest[0][0] - want[:n0]).max())
        for t, logits in zip(range(n0, len(probes[-1])), rest[1:], strict=True):
            worst = max(worst, float(np.abs(logits[0, -1] - want[t]).max()))
        checked = DecodeCheck(prefill_tokens=n0, steps=decode_steps, max_abs_logit_diff=worst)
    record = ParityRecord(
        runtime=runtime,
        reference=reference,
        seq_lens=tuple(lens),
        wrapper=wrapper or None,
        decode=checked,
        tokens_scored=sum(len(w) - 1 for w in ppl_windows),
        reference_max_logit=round(max(float(np.abs(r).max()) for r in ref[: len(probes)]), 4),
    )
    return record.with_figures(vs)


def graph_parity(
    hf: nn.Module,
    export_model: nn.Module,
    tok: PreTrainedTokenizerBase,
    text: str,
    prefill: Prefill,
    decode: Decode | None,
    *,
    runtime: str,
    seq_lens: tuple[int, ...] = (32, 128),
) -> JsonObject:
    """:func:`measure_graph` as the manifest's JSON (for the TFLite worker, which reports JSON to its parent)."""
    return measure_graph(hf, export_model, tok, text, prefill, decode, runtime=runtime, seq_lens=seq_lens).to_json()


# max |Δlogit| of a float32 artifact per unit of the reference's largest |logit| (at least one unit): float32 kernels
# that sum in another order differ by a relative 1e-7 per operation, which grows with depth and with the logits'
# size. The tests' tiny models (logits well under 1) are held to 1e-4 itself; the real 30-layer SmolLM2 MoE (logits
# up to about 20) differed by 2.8e-4 in LiteRT's float32 kernels, chunked or not, 1.4e-5 of its largest logit
FP32_GATE = 1e-4


def judge(record: ParityRecord, what: str, *, limit: float = FP32_GATE) -> ParityRecord:
    """``record`` held to ``limit`` (max |Δlogit| over every prefill length and the cached decode) per unit of the
    reference's largest |logit| (``reference_max_logit``; at least one unit).

    Raises:
        ExportError: the worst difference exceeds the limit (naming ``what`` and the limit).
    """
    limit *= max(1.0, record.reference_max_logit or 0.0)
    judged = record.judged(limit)
    if judged.outcome != "pass":
        worst = judged.worst_logit_diff
        shown = "unmeasured" if worst is None else f"{worst:.3g}"
        scale = record.reference_max_logit
        per = f" ({FP32_GATE:g} per unit of the reference's largest |logit|, {scale:g})" if scale and scale > 1 else ""
        raise ExportError(f"{what} parity failed: max |Δlogit| {shown} > {limit:g}{per}")
    return judged
