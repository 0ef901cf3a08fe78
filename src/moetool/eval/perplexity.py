"""Held-out perplexity of causal language models, and model x domain perplexity matrices."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

import torch
import torch.nn.functional as F
from rich.table import Table

from moetool import registry
from moetool.compute.stream import NonFiniteModel, stream_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from moetool.routing.tap import RouterTap

__all__ = [
    "LogitsModel",
    "NonFiniteModel",
    "Windowing",
    "load_causal_lm",
    "nonfinite_weight",
    "perplexity",
    "perplexity_matrix",
    "render_matrix",
    "token_nll",
]


def nonfinite_weight(model: torch.nn.Module) -> str | None:
    """The name of the first floating-point parameter of ``model`` holding a NaN or an Inf, or None.

    One reduction per tensor in its own dtype (finite extremes prove every element finite; NaN propagates into
    both), as :meth:`moetool.io.checkpoint.Checkpoint.check` does when a merge reads its inputs.
    """
    for name, p in model.named_parameters():
        if not p.is_floating_point() or p.numel() == 0 or p.is_meta:  # meta: a streamed layer, checked as it is read
            continue
        lo, hi = torch.aminmax(p.detach().reshape(-1))
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            return str(name)
    return None


LogitsModel = torch.nn.Module | Callable[..., torch.Tensor]
"""What is scored: a causal LM called as ``model(input_ids=[B, T])`` giving ``.logits`` ``[B, T, V]`` (a transformers
model's output), or a callable giving the logits themselves."""

ModelSpec = str | Path | tuple[LogitsModel, "PreTrainedTokenizerBase"]


class Windowing(TypedDict, total=False):
    """How a text is scored (:func:`token_nll`), each left out at its default."""

    seq_len: int  # model inputs per window, BOS included
    max_tokens: int | None  # score at most this many text tokens (None: all)
    batch_size: int  # windows per forward pass


def _model_device(model: LogitsModel) -> torch.device:
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def _is_transformers(model: LogitsModel) -> bool:
    """True for a transformers model (which takes ``use_cache``), not a wrapper scored through its own call."""
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def text_windows(ids: list[int], seq_len: int, bos_id: int | None) -> list[list[int]]:
    """Cut ``ids`` into non-overlapping windows of at most ``seq_len`` model inputs.

    With a BOS token every window is ``[bos] + ids[i : i + seq_len - 1]`` and all of its content tokens are scored;
    without one every window is ``ids[i : i + seq_len]`` and its first token is context only.
    """
    step = seq_len - 1 if bos_id is not None else seq_len
    out: list[list[int]] = []
    for start in range(0, len(ids), step):
        chunk = ids[start : start + step]
        window = [bos_id, *chunk] if bos_id is not None else chunk
        if len(window) >= 2:
            out.append(window)
    return out


NLL_ROWS = 512  # positions whose loss is computed at once


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ −log p(target) over ``logits`` ``[B, T, V]`` for ``targets`` ``[B, T]`` (−100: not scored), in float64, a
    slice of :data:`NLL_ROWS` positions at a time: the loss's float32 copies (about 20 bytes per logit) then cover
    one slice, not the batch (at 4,096 positions of a 49,152-token vocabulary that was 4 GB)."""
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for b in range(logits.shape[0]):
        for s in range(0, logits.shape[1], NLL_ROWS):
            part = logits[b, s : s + NLL_ROWS].float()
            nll = F.cross_entropy(part, targets[b, s : s + NLL_ROWS], reduction="sum", ignore_index=-100)
            total += nll.double()
    return total


def _batches(windows: list[list[int]], batch_size: int, *, pad: bool) -> list[list[tuple[list[int], int]]]:
    """``windows`` in batches of ``batch_size``, each window with the length it runs at. The shorter last window
    runs alone, or with ``pad`` (a model streamed from disk, for which every batch reads the whole checkpoint) padded
    at its end to the others' length in the last batch: a causal LM's logits at a position do not depend on the
    tokens after it."""
    n = len(windows[0])
    full = [w for w in windows if len(w) == n]
    rest = windows[len(full) :]  # at most one, shorter window at the end
    if pad:
        return [[(w, n) for w in windows[i : i + batch_size]] for i in range(0, len(windows), batch_size)]
    return [[(w, n) for w in full[i : i + batch_size]] for i in range(0, len(full), batch_size)] + [
        [(w, len(w))] for w in rest
    ]


@torch.inference_mode()
def token_nll(
    model: LogitsModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    seq_len: int = 256,
    max_tokens: int | None = 32768,
    batch_size: int = 8,
    tap: RouterTap | None = None,
) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of the tokens of ``text`` and how many tokens were scored.

    ``text`` is tokenized once without special tokens, truncated to ``max_tokens`` tokens, and cut into
    non-overlapping windows (see :func:`perplexity`). Windows are run ``batch_size`` at a time: input ids
    ``[B, T]`` with ``T <= seq_len``, logits ``[B, T, V]``; position ``t`` predicts token ``t + 1``. ``tap``, when
    given, is told which tokens are the text's (a padded window's padding is not).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    ids: list[int] = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    bos_id = getattr(tokenizer, "bos_token_id", None)
    windows = text_windows(ids, seq_len, bos_id)
    if not windows:
        raise ValueError("text is too short to score: it needs at least two tokens (or one with a BOS token)")

    device = _model_device(model)
    module = model if isinstance(model, torch.nn.Module) else None
    was_training = module is not None and module.training
    if module is not None:
        module.eval()
    total_nll = 0.0
    total_tokens = 0
    # a transformers model keeps a KV cache of every layer through its forward unless told not to (at Mistral-7B's
    # shape 0.26 MB per position: 1.07 GB over 4,096 tokens); scoring never reads it
    scoring = {"use_cache": False} if _is_transformers(model) else {}
    try:
        for batch in _batches(windows, batch_size, pad=module is not None and stream_of(module) is not None):
            input_ids = torch.tensor([w + w[-1:] * (n - len(w)) for w, n in batch], dtype=torch.long, device=device)
            if tap is not None:
                tap.keep = torch.tensor([i < len(w) for w, n in batch for i in range(n)], device=device)
            out = model(input_ids=input_ids, **scoring)  # [B, T]
            logits = out.logits if hasattr(out, "logits") else out  # [B, T, V]
            targets = input_ids[:, 1:].clone()  # [B, T-1]
            for row, (w, _) in enumerate(batch):
                targets[row, len(w) - 1 :] = -100  # a padded window's padding is not scored
            nll = summed_nll(logits[:, :-1, :], targets)
            del logits, out
            if not bool(torch.isfinite(nll)):  # a NaN or Inf logit: every figure from here on would be one too
                raise NonFiniteModel(
                    "the model computes non-finite logits (NaN or Inf) on this text: its weights hold NaN or Inf, "
                    "or its activations overflow"
                )
            total_nll += float(nll)
            total_tokens += sum(len(w) - 1 for w, _ in batch)
    finally:
        if tap is not None:
            tap.keep = None
        if module is not None and was_training:
            module.train()
    return total_nll, total_tokens


def perplexity(
    model: LogitsModel, tokenizer: PreTrainedTokenizerBase, text: str, **windowing: Unpack[Windowing]
) -> float:
    """Perplexity ``exp(mean token NLL)`` of ``model`` on ``text``.

    The text is tokenized once (no special tokens), truncated to its first ``max_tokens`` tokens (``None``: no
    limit) and cut into non-overlapping windows: with a BOS token each window is ``<s>`` followed by
    ``seq_len - 1`` text tokens (the BOS itself is never scored, every text token is), without one each window is
    ``seq_len`` text tokens of which all but the first are scored. Runs under :func:`torch.inference_mode`.

    Args:
        model: a causal LM called as ``model(input_ids=[B, T]) -> .logits [B, T, V]`` (or returning the logits).
        tokenizer: a ``transformers`` tokenizer (``bos_token_id`` is used when set).
        text: the text to score.
        windowing: ``seq_len``, ``max_tokens`` and ``batch_size`` (:class:`Windowing`), as :func:`token_nll` takes
            them and with its defaults.
    """
    nll, n = token_nll(model, tokenizer, text, **windowing)
    return math.exp(nll / n)


def load_causal_lm(
    path: str | Path, *, dtype: str | None = "float32", device: str | None = "cpu", streamed: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a ``save_pretrained`` directory in eval mode.

    ``dtype``: float32, bfloat16, float16, or ``auto`` (the checkpoint's own); ``device``: cpu, cuda[:N] or
    ``auto`` (a GPU when there is one). A 16-bit model on a device without a native matmul of its dtype (a CPU
    without AVX512-BF16 or AMX, where PyTorch's fallback is 10-20× slower than float32) computes in float32 over its
    16-bit weights, one layer upcast at a time: faster, exact, and one float32 layer more memory. ``streamed``: the
    decoder layers stay on disk and are read, in float32, when each runs (:func:`moetool.compute.stream.
    streamed_causal_lm`; on the CPU, for a model larger than memory: see :func:`eval_residency`).

    Raises:
        MoetoolError: an unknown dtype or device, or CUDA asked for where there is none.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moetool.compute.dtypes import resolve_device, resolve_dtype
    from moetool.compute.stream import streamed_causal_lm
    from moetool.compute.upcast import float32_layer_by_layer, native_matmul

    registry.load_all_methods()  # a moetool output (moetool_gem, …) loads through the Auto classes only once registered
    storage, where = resolve_dtype(dtype, Path(path)), resolve_device(device)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if streamed:
        return streamed_causal_lm(Path(path), storage=storage), tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=storage)
    module: torch.nn.Module = model  # transformers types its own ``to`` (functools.wraps of Module's) as unbound
    module.to(where)  # in place
    model.eval()
    if not native_matmul(storage, where):
        float32_layer_by_layer(model)
    return model, tokenizer


def perplexity_matrix(
    models: Mapping[str, ModelSpec],
    texts: Mapping[str, str],
    **windowing: Unpack[Windowing],
) -> dict[str, dict[str, float]]:
    """Perplexity of every model on every text: ``matrix[model_name][text_name]``.

    Args:
        models: name -> a ``save_pretrained`` directory (loaded once with ``AutoModelForCausalLM`` in float32
            and ``AutoTokenizer``) or an already loaded ``(model, tokenizer)`` pair.
        texts: name -> text (e.g. each domain's held-out split).
        **windowing: passed to :func:`perplexity` (``seq_len``, ``max_tokens``, ``batch_size``).
    """
    matrix: dict[str, dict[str, float]] = {}
    for name, spec in models.items():
        loaded = isinstance(spec, str | Path)
        model, tokenizer = load_causal_lm(spec) if isinstance(spec, str | Path) else spec
        try:
            matrix[name] = {t: perplexity(model, tokenizer, text, **windowing) for t, text in texts.items()}
        finally:
            if loaded:
                del model, tokenizer
                gc.collect()
    return matrix


def render_matrix(
    matrix: Mapping[str, Mapping[str, float]],
    title: str = "held-out perplexity (lower is better)",
) -> Table:
    """A rich table with one row per model and one column per text; the best (lowest) value per column is bold."""
    columns: list[str] = []
    for row in matrix.values():
        for col in row:
            if col not in columns:
                columns.append(col)
    best = {col: min((row[col] for row in matrix.values() if col in row), default=math.inf) for col in columns}
    table = Table(title=title)
    table.add_column("model", style="bold")
    for col in columns:
        table.add_column(col, justify="right")
    for name, row in matrix.items():
        cells = []
        for col in columns:
            if col not in row:
                cells.append("-")
                continue
            value = row[col]
            text = f"{value:.2f}"
            cells.append(f"[bold green]{text}[/]" if value == best[col] else text)
        table.add_row(name, *cells)
    return table
