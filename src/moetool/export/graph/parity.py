"""Parity of a graph artifact in its runtime against transformers (fp32): two prefill lengths, a decode run with
the KV cache, and top-1 agreement and perplexity on held-out windows."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from moetool.export.base import ExportError
from moetool.export.graph.model import prefill_inputs
from moetool.export.heldout import agreement, windows

Prefill = Callable[[np.ndarray], tuple[np.ndarray, list[np.ndarray]]]  # ids [1, T] → (logits, present)
Decode = Callable[[np.ndarray, int, list[np.ndarray]], tuple[np.ndarray, list[np.ndarray]]]  # (ids [1,1], pos, past)


def graph_parity(
    hf: Any,
    export_model: Any,
    tok: PreTrainedTokenizerBase,
    text: str,
    prefill: Prefill,
    decode: Decode | None,
    *,
    runtime: str,
    seq_lens: tuple[int, ...] = (32, 128),
    n_windows: int = 4,
    decode_steps: int = 8,
) -> dict[str, Any]:
    """Figures for the manifest. ``export_model`` (the torch wrapper that was converted) is compared too, so a
    mismatch can be told apart from the conversion's."""

    max_pos = int(getattr(hf.config, "max_position_embeddings", 2048))
    lens = sorted({min(n, max_pos) for n in seq_lens})
    probes, ppl_windows = windows(tok, text, lens, n_windows)
    got = [prefill(np.array([ids], dtype=np.int64))[0][0] for ids in probes + ppl_windows]
    vs = agreement(got, hf, probes, ppl_windows)
    wrapper: dict[str, float] = {}
    for ids in probes:
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = hf(x).logits[0].numpy()
            ours = export_model(*prefill_inputs(x))[0][0].numpy()
        wrapper[str(len(ids))] = float(np.abs(ref - ours).max())
    out: dict[str, Any] = {
        "runtime": runtime,
        "reference": "transformers float32",
        "seq_lens": lens,
        "max_abs_logit_diff": vs.max_abs_logit_diff,
        "export_model_vs_transformers": wrapper,
    }
    if decode is not None:
        ids = probes[-1]
        n0 = len(ids) - decode_steps
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        logits, past = prefill(np.array([ids[:n0]], dtype=np.int64))
        worst = float(np.abs(logits[0] - ref[:n0]).max())
        for t in range(n0, len(ids)):
            logits, past = decode(np.array([[ids[t]]], dtype=np.int64), t, past)
            worst = max(worst, float(np.abs(logits[0, -1] - ref[t]).max()))
        out["decode"] = {"prefill_tokens": n0, "steps": decode_steps, "max_abs_logit_diff": worst}
    out |= vs.to_json() | {"tokens_scored": sum(len(w) - 1 for w in ppl_windows)}
    return out


FP32_GATE = 1e-4


def gate(parity: dict[str, Any], what: str, *, limit: float = FP32_GATE) -> None:
    """Raise when the worst logit difference (both prefill lengths and the cached decode) exceeds ``limit``."""

    worst = max([*parity["max_abs_logit_diff"].values(), parity["decode"]["max_abs_logit_diff"]])
    if worst > limit:
        raise ExportError(f"{what} parity failed: max |Δlogit| {worst:.3g} > {limit:g}")
