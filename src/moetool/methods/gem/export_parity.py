"""Parity of GEM's exported graphs against PyTorch: the held-out probes, and the one comparison of logits, router
probabilities and routes that every runtime (onnxruntime, the LiteRT interpreter) goes through."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onnxruntime import InferenceSession
    from transformers import PreTrainedTokenizerBase

    from moetool.methods.gem.evaluate import SequenceGem
    from moetool.methods.gem.model import GemForCausalLM

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from moetool.export.graph.model import causal_mask
from moetool.export.heldout import held_out_text, nll
from moetool.export.parity import ParityRecord, RouteCheck
from moetool.extras import require
from moetool.methods.gem.heldout import domain_held_out
from moetool.recipe.kept import KEPT_RECIPE

__all__ = [
    "PARITY_LIMIT",
    "SEQ_LENS",
    "gated",
    "onnx_feeds",
    "ort_session",
    "parity_failed",
    "probe_windows",
    "route_parity",
    "router_parity",
    "token_parity",
]

PARITY_LIMIT = 1e-4  # fp32 graph vs PyTorch, max |Δlogit|
SEQ_LENS = (32, 128)

# ids [T] -> the runtime's (logits [1, T, V], router_probs [1, T, n], routes [1, T]) for exactly those tokens
TokenRun = Callable[[list[int]], tuple[np.ndarray, np.ndarray, np.ndarray]]


def ort_session(path: Path) -> InferenceSession:

    ort = require("onnxruntime", "onnx", why="checking a GEM ONNX graph")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    session: InferenceSession = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return session


def onnx_feeds(ids: list[int]) -> dict[str, np.ndarray]:
    """The inputs of a GEM ONNX graph for ``ids``: input_ids, position_ids ``[1, T]``, causal mask ``[1, 1, T, T]``."""
    return {
        "input_ids": np.asarray([ids], dtype=np.int64),
        "position_ids": np.arange(len(ids))[None],
        "mask": causal_mask(len(ids), 0).numpy(),
    }


def probe_windows(tok: PreTrainedTokenizerBase, model_dir: Path, lengths: tuple[int, ...]) -> list[list[int]]:
    """One window per length per domain of held-out text (so routes cover general and every pathway).

    Raises:
        MoetoolError: a domain's held-out text cannot be read (naming it).
    """

    # every domain's own held-out text, whatever its source (zoo, a local file, a cached dataset); a model with no
    # kept recipe (none of moetool's GEM outputs) gets the mixed held-out sample
    if (model_dir / KEPT_RECIPE).is_file():
        texts = [text[:20000] for text in domain_held_out(model_dir).values()]
    else:
        texts = [held_out_text(model_dir)[0]]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    tok.model_max_length = 10**9  # windows are cut below
    out = []
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        for n in lengths:
            if len(ids) >= n:
                out.append(bos + ids[: n - len(bos)])
    return out


@torch.no_grad()
def route_parity(model: GemForCausalLM, probes: list[list[int]], run: TokenRun, *, runtime: str) -> ParityRecord:
    """The runtime (``run``) against the PyTorch ``model`` on each probe: max |Δlogit|, max |ΔP|, routes that differ
    (for an fp32 graph a route may only differ where max P is within 1e-5 of tau, where the runtimes round
    differently), top-1 agreement and both perplexities over the probes (what a quantized graph costs)."""

    agree = 0
    nll_ref = nll_got = 0.0
    worst_logit = worst_p = 0.0
    mism = mism_off = tokens = 0
    domains, tau = list(model.config.domains), float(model.config.tau)
    share = torch.zeros(len(domains) + 1)
    for ids in probes:
        ref = model(torch.tensor([ids]))
        logits, probs, routes = run(ids)
        worst_logit = max(worst_logit, float(np.abs(logits - ref.logits.numpy()).max()))
        worst_p = max(worst_p, float(np.abs(probs - ref.router_probs.numpy()).max()))
        diff = routes != ref.routes.numpy()
        mism += int(diff.sum())
        near = np.abs(ref.router_probs.numpy().max(-1) - tau) < 1e-5
        mism_off += int((diff & ~near).sum())
        tokens += len(ids)
        agree += int((logits[0].argmax(-1) == ref.logits[0].numpy().argmax(-1)).sum())
        nll_ref += nll(ref.logits[0].numpy(), ids)[0]
        nll_got += nll(logits[0], ids)[0]
        share += torch.bincount(ref.routes.reshape(-1), minlength=len(share)).float()
    names = ["general", *domains]
    scored = tokens - len(probes)
    return ParityRecord(
        runtime=runtime,
        reference="PyTorch moetool_gem float32",
        seq_lens=tuple(sorted({len(p) for p in probes})),
        windows=len(probes),
        tokens=tokens,
        max_abs_logit_diff=worst_logit,
        top1_agreement=round(agree / tokens, 6),
        ppl_reference=round(math.exp(nll_ref / scored), 4),
        ppl_artifact=round(math.exp(nll_got / scored), 4),
        routes=RouteCheck(
            max_abs_prob_diff=worst_p,
            mismatches=mism,
            mismatches_off_boundary=mism_off,
            share={n: round(float(s / tokens), 4) for n, s in zip(names, share, strict=True)},
        ),
    )


def parity_failed(parity: ParityRecord) -> bool:
    """The fp32 gate of a token graph: logits within :data:`PARITY_LIMIT`, no route off the tau boundary differs."""
    worst = parity.worst_logit_diff
    off = parity.routes.mismatches_off_boundary if parity.routes is not None else None
    return worst is None or worst > PARITY_LIMIT or bool(off)


def gated(parity: ParityRecord, *, quantized: bool) -> ParityRecord:
    """The record with its verdict: an fp32 graph is held to :data:`PARITY_LIMIT` (and no route off the tau boundary
    may differ: :func:`parity_failed`), a quantized graph's figures are reported."""
    if quantized:
        return replace(parity, verdict="reported")
    return replace(parity, tolerance=PARITY_LIMIT, verdict="fail" if parity_failed(parity) else "pass")


def token_parity(model: GemForCausalLM, path: Path, probes: list[list[int]]) -> ParityRecord:
    """:func:`route_parity` of the ONNX graph at ``path`` in onnxruntime."""
    sess = ort_session(path)

    def run(ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        logits, probs, routes = sess.run(None, onnx_feeds(ids))
        return logits, probs, routes

    return route_parity(model, probes, run, runtime="onnxruntime")


def router_parity(seq: SequenceGem, path: Path, probes: list[list[int]]) -> ParityRecord:
    """The sequence-level router graph at ``path`` in onnxruntime against ``seq.route`` (PyTorch) on each probe:
    max |ΔP| and how many probes take the same route."""
    sess = ort_session(path)
    worst, agree = 0.0, 0
    for p in probes:
        ref_p, ref_r = seq.route(torch.tensor([p]))
        got_p, got_r = sess.run(None, onnx_feeds(p))
        worst = max(worst, float(np.abs(got_p - ref_p.numpy()).max()))
        agree += int((got_r == ref_r.numpy()).all())
    return ParityRecord(
        windows=len(probes),
        seq_lens=tuple(sorted({len(p) for p in probes})),
        routes=RouteCheck(max_abs_prob_diff=worst, same_route=agree),
    )
