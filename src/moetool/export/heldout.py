"""Held-out text and the figures every exporter reports against transformers: token windows, negative
log-likelihood, top-1 agreement and perplexity."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetool.export.base import ExportError
from moetool.io.safe import read_json
from moetool.io.sources import source_resolver

SAMPLE_TEXT = (
    "The parser reads each line, strips comments and splits the remaining tokens on whitespace. "
    "def tokenize(line):\n    return [t for t in line.split() if not t.startswith('#')]\n\n"
    "Licensor hereby grants to You a worldwide, royalty-free, non-exclusive licence to reproduce the Work. "
    'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED.\n'
    "Type 2 diabetes mellitus with diabetic chronic kidney disease; acute bronchitis due to rhinovirus; "
    "fracture of the shaft of the right femur, initial encounter for closed fracture.\n"
) * 8


def model_name(model_dir: Path) -> str:
    info = model_dir / "moetool.json"
    if info.is_file():
        with_name = read_json(info, what="moetool metadata").get("name")
        if with_name:
            return str(with_name)
    return model_dir.resolve().name


def held_out_text(model_dir: Path, override: str | None = None) -> tuple[str, str]:
    """Text for parity and the perplexity change, and where it came from.

    ``override`` (``--eval-text``) wins; models built from the zoo are scored on the zoo's held-out splits
    (interleaved across domains); others on a built-in multi-domain sample.
    """
    if override:
        return override, "user"
    info = model_dir / "moetool.json"
    zoo = False
    if info.is_file():
        prov = read_json(info, what="moetool metadata").get("provenance")
        srcs = prov.get("sources") if isinstance(prov, dict) else None
        zoo = (
            isinstance(srcs, dict)
            and bool(srcs)
            and all(isinstance(s, dict) and s.get("kind") == "zoo" for s in srcs.values())
        )
    if not zoo and (model_dir.resolve().parent / "zoo.json").is_file():  # a zoo model itself
        zoo = True
    if zoo:
        try:
            source = source_resolver("zoo")  # the zoo's source plugin: it sits above export, which never imports it
            parts = [source.domain_text(d, "valid")[:6000] for d in source.domains]
            return "\n".join(p for trio in zip(*(t.split("\n") for t in parts), strict=False) for p in trio), "zoo"
        except Exception:  # the zoo cache may be gone; the sample still proves parity
            pass
    return SAMPLE_TEXT, "builtin-sample"


def windows(
    tok: PreTrainedTokenizerBase, text: str, seq_lens: list[int], n_windows: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Token windows: one per probe length (for logit diffs) and ``n_windows`` of the longest (for perplexity)."""
    tok.model_max_length = 10**9  # windows are cut below; silence the "longer than the maximum" warning
    ids = tok(text, add_special_tokens=False).input_ids
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    longest = max(seq_lens)
    need = longest - len(bos)
    if len(ids) < need:
        raise ExportError(f"held-out text has {len(ids)} tokens; parity needs at least {need}")
    probes = [bos + ids[: n - len(bos)] for n in seq_lens]
    step = max(need, (len(ids) - need) // max(n_windows - 1, 1))
    ppl = [bos + ids[s : s + need] for s in range(0, len(ids) - need + 1, step)][:n_windows]
    return probes, ppl


def nll(logits: np.ndarray, ids: list[int]) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of ``ids`` under ``logits`` [T, V], and the tokens scored."""
    x = logits[:-1].astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(x).sum(axis=-1))
    tgt = np.asarray(ids[1:])
    per_token = logz - x[np.arange(len(tgt)), tgt]
    return float(per_token.sum()), len(tgt)


@dataclass
class Agreement:
    """llama.cpp against one transformers reference on the same ids."""

    max_abs_logit_diff: dict[str, float]  # per probe length
    top1_agreement: float
    ppl_reference: float
    ppl_artifact: float

    @property
    def ppl_change(self) -> float:
        return self.ppl_artifact / self.ppl_reference - 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "top1_agreement": round(self.top1_agreement, 6),
            "ppl_reference": round(self.ppl_reference, 4),
            "ppl_artifact": round(self.ppl_artifact, 4),
            "ppl_change": round(self.ppl_change, 6),
        }


def reference_logits(model: nn.Module, seqs: list[list[int]]) -> list[np.ndarray]:
    """``model``'s (transformers) float32 logits ``[T, V]`` for each of ``seqs``, in order: one forward pass each,
    or, for a model streamed from disk (:mod:`moetool.compute.stream`: each pass reads every layer), one pass for
    all of them."""
    import torch

    from moetool.compute.stream import stream_of

    if stream_of(model) is None:
        out = []
        for ids in seqs:
            with torch.no_grad():
                out.append(model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy())
        return out
    # a causal LM's logits at a position do not depend on the tokens after it: each sequence is padded at its end to
    # the longest (with its own last token) and the padding's logits dropped, so one pass reads the checkpoint once
    longest = max(len(s) for s in seqs)
    with torch.inference_mode():  # no KV cache: kept for every layer, it would be 1 GB over 4,096 tokens at 7B
        padded = torch.tensor([s + s[-1:] * (longest - len(s)) for s in seqs])
        logits = model(padded, use_cache=False).logits.float().numpy()
    return [logits[row, : len(s)] for row, s in enumerate(seqs)]


def agreement(
    got: list[np.ndarray], model: nn.Module, probes: list[list[int]], ppl_windows: list[list[int]]
) -> Agreement:
    """A runtime's logits (``got``, one array per probe then per window) against ``model`` (transformers) on the same
    ids: max |Δ| per probe length; top-1 agreement and both perplexities over the windows."""
    return agreement_of(got, reference_logits(model, probes + ppl_windows), probes, ppl_windows)


def agreement_of(
    got: list[np.ndarray], ref: list[np.ndarray], probes: list[list[int]], ppl_windows: list[list[int]]
) -> Agreement:
    """:func:`agreement` over logits already computed: ``ref`` in the same order as ``got``."""
    diffs = {str(len(ids)): float(np.abs(r - g).max()) for ids, r, g in zip(probes, ref, got, strict=False)}
    agree = total = 0
    nll_ref = nll_got = 0.0
    scored = 0
    for ids, r, g in zip(ppl_windows, ref[len(probes) :], got[len(probes) :], strict=True):
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += len(ids)
        a, n = nll(r, ids)
        b, _ = nll(g, ids)
        nll_ref, nll_got, scored = nll_ref + a, nll_got + b, scored + n
    return Agreement(diffs, agree / max(total, 1), math.exp(nll_ref / scored), math.exp(nll_got / scored))
