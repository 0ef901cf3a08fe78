"""Measure what quantizing each tensor costs, then choose its type under a byte budget (:mod:`moetool.quant.allocate`).

For every tensor the allocation decides (a "bank": one layer's stacked experts of one projection, one attention
projection, the embeddings), the model runs on calibration windows with that bank alone rounded by ggml (with the
importance matrix) to each candidate type but the most precise, and the KL divergence of its next-token distribution
from the unrounded model's is the bank's cost at that type; the top candidate's is estimated from the importance-
weighted rounding error (each expert weighted by its share of calibration tokens). Candidates another beats on both
bytes and error are dropped first, so q4_0 and iq4_nl (the same bytes) cost one measurement.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from moetool.export.base import ExportError
from moetool.export.gguf import ggml
from moetool.export.gguf.names import gguf_name
from moetool.progress import silent, task
from moetool.quant.allocate import Bank
from moetool.quant.imatrix import Calibration, ImportanceMatrix
from moetool.quant.types import TYPES

if TYPE_CHECKING:
    from rich.console import Console

# candidates by row length: 256-blocks where rows allow, else the 32-block types (llama.cpp's fallbacks)
LADDER_256 = ("q2_k", "q3_k", "iq4_xs", "q4_k", "q5_k", "q6_k", "q8_0")
LADDER_32 = ("q4_0", "iq4_nl", "q4_1", "q5_0", "q5_1", "q8_0")


def candidates(row: int, allowed: tuple[str, ...] | None = None) -> list[str]:
    """Candidate types for rows of length ``row``."""
    pool = LADDER_256 if row % 256 == 0 else LADDER_32
    out = [t for t in pool if row % TYPES[t].block == 0 and (allowed is None or t in allowed)]
    return out or ["f16"]


def undominated(errors: dict[str, float], shape: tuple[int, ...]) -> dict[str, float]:
    """The candidates no other beats on both bytes and error (q4_0 and iq4_nl cost the same: the better stays)."""
    size = {t: TYPES[t].nbytes(shape) for t in errors}
    return {
        t: e
        for t, e in errors.items()
        if not any(
            (size[o] <= size[t] and errors[o] <= e) and (size[o] < size[t] or errors[o] < e or o < t)
            for o in errors
            if o != t
        )
    }


def _weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, slice | None]]:
    """GGUF tensor name → (the in-memory parameter, the row slice of it that tensor is), for the banks."""
    from moetool.routing.tap import experts_modules

    out: dict[str, tuple[torch.Tensor, slice | None]] = {}
    for qual, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear | torch.nn.Embedding):
            mapped = gguf_name(qual + ".weight")
            if mapped is not None and mapped[1] is None:
                out.setdefault(mapped[0], (mod.weight, None))
    for i, experts in experts_modules(model).items():
        ff = experts.gate_up_proj.shape[1] // 2
        out[f"blk.{i}.ffn_gate_exps.weight"] = (experts.gate_up_proj, slice(0, ff))
        out[f"blk.{i}.ffn_up_exps.weight"] = (experts.gate_up_proj, slice(ff, 2 * ff))
        out[f"blk.{i}.ffn_down_exps.weight"] = (experts.down_proj, None)
    return out


def _view(param: torch.Tensor, rows: slice | None) -> torch.Tensor:
    return param.data if rows is None else param.data[..., rows, :]


def _rounded(w: np.ndarray, t: str, imp: np.ndarray | None) -> np.ndarray:
    """``w`` (``[E, r, c]`` or ``[r, c]``) rounded to ``t`` per matrix, with that matrix's importance row."""
    if w.ndim == 2:
        return ggml.round_trip(w, t, None if imp is None else imp[0])
    return np.stack([ggml.round_trip(w[e], t, None if imp is None else imp[e]) for e in range(w.shape[0])])


@contextmanager
def _swapped(view: torch.Tensor, values: np.ndarray) -> Iterator[None]:
    keep = view.clone()
    view.copy_(torch.from_numpy(values).to(view.dtype))
    try:
        yield
    finally:
        view.copy_(keep)


def _logprobs(model: nn.Module, windows: list[list[int]], dev: torch.device) -> list[torch.Tensor]:
    return [
        torch.log_softmax(model(input_ids=torch.tensor([w], device=dev), use_cache=False).logits[0].float(), -1)
        for w in windows
    ]


def _kl(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    total, n = 0.0, 0
    for p, q in zip(ref, got, strict=True):
        total += float((p.exp() * (p - q)).sum())
        n += p.shape[0]
    return total / max(1, n)


CACHE_FORMAT = 1


def measure_cached(
    model_dir: Path,
    calib: Calibration,
    imatrix: ImportanceMatrix,
    banks: dict[str, str],
    *,
    console: Console | None = None,
) -> list[Bank]:
    """:func:`measure`, kept in the cache under a key of everything it depends on (the weights' bytes, the
    importance, the text, the candidates), so a second budget on the same model costs no measurement. A vanished or
    unreadable entry is measured again."""
    import hashlib
    import json

    from moetool.io.atomic import atomic_write_text
    from moetool.io.checkpoint import Checkpoint
    from moetool.io.hashes import cached_sha256
    from moetool.paths import cache_dir

    h = hashlib.sha256(f"{CACHE_FORMAT}|{LADDER_256}|{LADDER_32}|{sorted(banks.items())}".encode())
    ckpt = Checkpoint(model_dir)
    files = ckpt.weight_files
    ckpt.close()
    for f, digest in sorted(cached_sha256(files).items()):
        h.update(f"{f.name}:{digest}".encode())
    for name in sorted(banks):
        e = imatrix.entries.get(name)
        h.update(name.encode() + (e.values().tobytes() if e is not None else b"-"))
    h.update(json.dumps(dict(calib.texts), sort_keys=True).encode())
    path = cache_dir() / "allocation" / f"{h.hexdigest()[:32]}.json"
    try:
        rows = json.loads(path.read_text())
        return [Bank(**{**r, "shape": tuple(r["shape"])}) for r in rows]
    except (OSError, ValueError, TypeError, KeyError):
        pass
    out = measure(model_dir, calib, imatrix, banks, console=console)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps([b.__dict__ for b in out]))
    return out


@torch.inference_mode()
def measure(
    model_dir: Path,
    calib: Calibration,
    imatrix: ImportanceMatrix,
    banks: dict[str, str],
    *,
    probe_tokens: int = 256,
    device: str | None = None,
    console: Console | None = None,
) -> list[Bank]:
    """A :class:`Bank` (candidates' errors, the measured KL at the cheapest) for each tensor in ``banks`` (GGUF name →
    role).

    Raises:
        ExportError: a bank that is not a weight of the loaded model.
    """
    from moetool.eval.perplexity import load_causal_lm, text_windows

    console = console if console is not None else silent()
    model, tok = load_causal_lm(model_dir, dtype="float32", device=device or "auto")
    dev = next(model.parameters()).device
    per = max(64, probe_tokens // max(1, len(calib.texts)))
    windows = [
        w
        for text in calib.texts.values()
        for w in text_windows(tok(text[: per * 32], add_special_tokens=False)["input_ids"][:per], per, tok.bos_token_id)
    ][: max(1, probe_tokens // 64)]
    weights = _weights(model)
    missing = [n for n in banks if n not in weights]
    if missing:
        raise ExportError(f"bit allocation: {missing[0]} is not a weight this model exposes ({len(missing)} so)")
    ref = _logprobs(model, windows, dev)
    routed = (imatrix.info or {}).get("routed_tokens") or {}
    out = []
    with task(console, "measuring each tensor's sensitivity", len(banks), unit="tensors") as advance:
        for name, role in banks.items():
            param, rows = weights[name]
            view = _view(param, rows)
            w = view.float().cpu().numpy()
            entry = imatrix.entries.get(name)
            imp = None if entry is None else entry.values().reshape(entry.n_mat, -1)
            counts = np.asarray(routed.get(name) or (entry.counts if entry is not None else []), dtype=np.float64)
            share = list(counts / counts.sum()) if w.ndim == 3 and counts.size and counts.sum() > 0 else []
            weight = np.asarray(share)[:, None, None] if share else 1.0
            col = imp[:, None, :] if imp is not None and w.ndim == 3 else (imp if imp is not None else 1.0)
            errors = {}
            for t in candidates(w.shape[-1]):
                errors[t] = float((weight * col * (w - _rounded(w, t, imp)) ** 2).sum())
            errors = undominated(errors, w.shape)
            order = sorted(errors, key=lambda t: (TYPES[t].nbytes(w.shape), errors[t]))
            kls = {}
            for t in order[:-1] if len(order) > 1 else order:  # the top (near-lossless) is estimated
                with _swapped(view, _rounded(w, t, imp)):
                    kls[t] = _kl(ref, _logprobs(model, windows, dev))
            out.append(Bank(name, role, tuple(w.shape), errors, kls, order[0], [float(s) for s in share]))
            advance()
    del model
    return out
