"""Collect an importance matrix for a model's GGUF tensors on calibration text, every expert included.

llama.cpp's ``llama-imatrix`` sums x² per input column of every matrix product over the tokens that reach it; an
expert only sees the tokens the router sends it, so one that calibration rarely routes to gets little or no data
and llama.cpp quantizes it with no importance at all. moetool collects the same statistics from hooks on the
transformers model (each linear layer's input; each MoE layer's experts module, which receives the router's choice)
and then makes sure every expert has data:

- ``routed``: llama.cpp's statistics (each expert over its routed tokens); an expert that got fewer than
  ``min_tokens`` is computed on *every* calibration token of its layer instead, in a second pass over the same text
  (its gate/up input is the layer's input; its down input its own activation there). ``min_tokens=0`` gives
  llama.cpp's collection as is.
- ``all``: every expert over every token (each expert computed on the layer's inputs regardless of the router).

The calibration text is one per domain (by default the recipe's training data, held-out split excluded), each cut to
the same token budget, so every domain's expert sees its own domain.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from moetool.export.base import ExportError
from moetool.export.gguf.names import gguf_name, split_names
from moetool.progress import silent, task
from moetool.quant.imatrix import MODES, Calibration, ImportanceMatrix
from moetool.routing.tap import FusedExperts, expert_activation, experts_modules

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase

    from moetool.eval.residency import Residency

EXPERT_PROJ = ("gate", "up", "down")
# Fewer calibration tokens than this draw a warning: the routed mode's default floor per expert (128), so below it
# even an expert routed every token is computed on all of them, and the matrix reflects the text, not the routing
MIN_CALIBRATION_TOKENS = 128


def expert_names(layer: int) -> dict[str, str]:
    """llama.cpp's names of one layer's stacked expert tensors, by projection."""
    return {p: f"blk.{layer}.ffn_{p}_exps.weight" for p in EXPERT_PROJ}


class _Collector:
    """Forward hooks accumulating Σ x² per column and token counts, keyed by GGUF tensor name."""

    def __init__(self, model: nn.Module, wanted: set[str]) -> None:
        self.wanted = wanted
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self.handles: list[RemovableHandle] = []
        self.forced: dict[int, list[int]] = {}  # layer → experts computed on every token
        self.second = False  # the pass for experts below the floor: nothing else is counted again
        self.layers: list[int] = []
        for qual, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                names = self._linear_names(qual)
                if names:
                    self.handles.append(mod.register_forward_pre_hook(self._linear_hook(names)))
        for i, experts in experts_modules(model).items():
            by_proj = expert_names(i)
            missing = [n for n in by_proj.values() if n not in wanted]
            if missing:
                raise ExportError(f"layer {i}: the GGUF layout has no {missing[0]} for the experts' statistics")
            self.layers.append(i)
            self.handles.append(experts.register_forward_hook(self._expert_hook(i, by_proj)))

    def _linear_names(self, qual: str) -> list[str]:
        hf = qual + ".weight"
        out = [n for n in split_names(hf) if n in self.wanted]
        mapped = gguf_name(hf)
        if mapped is not None and mapped[1] is None and mapped[0] in self.wanted:
            out.append(mapped[0])
        return out

    def _add(self, name: str, n_mat: int, sq: torch.Tensor, count: int, mat: int = 0) -> None:
        if name not in self.sums:
            self.sums[name] = torch.zeros(n_mat, sq.shape[-1], dtype=torch.float64)
            self.counts[name] = torch.zeros(n_mat, dtype=torch.float64)
        self.sums[name][mat] += sq.double().cpu()
        self.counts[name][mat] += count

    def _linear_hook(self, names: list[str]) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if self.second:
                return
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sq = (x * x).sum(0)
            for n in names:
                self._add(n, 1, sq, x.shape[0])

        return hook

    def _expert_hook(
        self, layer: int, names: dict[str, str]
    ) -> Callable[[FusedExperts, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def hook(module: FusedExperts, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
            hidden, index = args[0].detach(), args[1]
            n_exp = int(module.gate_up_proj.shape[0])
            forced = self.forced.get(layer)
            if self.second and forced is None:
                return
            every = torch.arange(hidden.shape[0], device=hidden.device)
            for e in range(n_exp) if forced is None else forced:
                token = every if forced is not None else torch.where(index == e)[0]
                if token.numel() == 0:
                    continue
                x = hidden[token]
                h = expert_activation(module, e, x).float()
                xf = x.float()
                sq_in = (xf * xf).sum(0)
                for p in ("gate", "up"):
                    self._add(names[p], n_exp, sq_in, token.numel(), mat=e)
                self._add(names["down"], n_exp, (h * h).sum(0), token.numel(), mat=e)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _windows(tok: PreTrainedTokenizerBase, calib: Calibration) -> dict[str, list[list[int]]]:
    from moetool.eval.perplexity import text_windows

    per = max(calib.seq_len, calib.max_tokens // max(1, len(calib.texts)))
    out = {}
    for d, text in calib.texts.items():
        ids = tok(text[: per * 32], add_special_tokens=False)["input_ids"][:per]
        out[d] = text_windows(ids, calib.seq_len, tok.bos_token_id)
    return out


@torch.inference_mode()
def collect(
    model_dir: Path,
    calib: Calibration,
    wanted: set[str],
    *,
    device: str | None = None,
    console: Console | None = None,
) -> ImportanceMatrix:
    """The importance matrix of the model at ``model_dir`` for the GGUF tensors named in ``wanted``.

    Raises:
        ExportError: an unknown mode, no calibration text, or a model whose experts this cannot read.
    """
    from moetool.eval.perplexity import load_causal_lm

    if calib.mode not in MODES:
        raise ExportError(f"imatrix mode {calib.mode!r}: choose {' or '.join(MODES)}")
    console = console if console is not None else silent()
    held = _residency(model_dir, calib, device)
    if held.streamed:
        console.print(f"importance matrix: {held.reason}", highlight=False)
    model, tok = load_causal_lm(model_dir, dtype="auto", device=device or "auto", streamed=held.streamed)
    windows = _windows(tok, calib)
    flat = [w for ws in windows.values() for w in ws]
    if not flat:
        raise ExportError("the calibration text gave no token window: give --calibration a file with text")
    tokens = {d: sum(len(w) for w in ws) for d, ws in windows.items()}
    if sum(tokens.values()) < MIN_CALIBRATION_TOKENS:
        console.print(
            f"[yellow]warning:[/] the importance matrix is collected on {sum(tokens.values())} calibration tokens "
            f"({calib.source}), fewer than {MIN_CALIBRATION_TOKENS}: its statistics measure little; give more text",
            highlight=False,
        )
    dev = next(model.parameters()).device
    col = _Collector(model, wanted)
    routed: dict[str, list[int]] = {}
    try:
        if calib.mode == "all":
            modules = experts_modules(model)
            col.forced = {layer: list(range(int(modules[layer].gate_up_proj.shape[0]))) for layer in col.layers}
        _run(model, flat, dev, console, "imatrix", held.batch_size)
        if calib.mode == "routed":
            routed = {n: [int(c) for c in col.counts[n]] for n in col.counts if col.counts[n].numel() > 1}
            starved = _starved(col, calib.min_tokens)
            if starved:
                for layer, experts in starved.items():
                    for name in expert_names(layer).values():
                        for e in experts:  # replaced, not added to: the few routed tokens are not a sample
                            col.sums[name][e] = 0
                            col.counts[name][e] = 0
                col.forced, col.second = starved, True
                _run(model, flat, dev, console, "imatrix (experts below the floor, every token)", held.batch_size)
    finally:
        col.remove()
    out = ImportanceMatrix(
        datasets=list(calib.texts),
        chunk_count=len(flat),
        chunk_size=calib.seq_len,
    )
    for name, sums in col.sums.items():
        out.add(name, sums.numpy(), col.counts[name].numpy())
    out.info = {
        "mode": calib.mode,
        "min_tokens": calib.min_tokens if calib.mode == "routed" else None,
        "source": calib.source,
        "tokens": tokens,
        "routed_tokens": routed or None,
        "forced": {str(k): v for k, v in col.forced.items()} if calib.mode == "routed" else "every expert",
        "held": held.reason or "resident",
    }
    del model
    return out


def _starved(col: _Collector, floor: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for layer in col.layers:
        counts = col.counts.get(expert_names(layer)["gate"])
        if counts is None:
            continue
        low = [e for e, c in enumerate(counts.tolist()) if c < floor]
        if low:
            out[layer] = low
    return out


def _residency(model_dir: Path, calib: Calibration, device: str | None) -> Residency:
    """Resident, or (on the CPU, when the model does not fit the memory available) streamed from disk one layer at
    a time with several windows per pass, as ``moetool eval`` decides (:func:`moetool.eval.perplexity.
    eval_residency`). A resident model runs one window per pass, as it always has.

    Raises:
        BudgetError: neither fits.
    """
    from moetool.compute.dtypes import resolve_device
    from moetool.eval.residency import Residency, eval_residency

    if resolve_device(device or "auto").type != "cpu":
        return Residency(streamed=False, batch_size=1)
    held = eval_residency(model_dir, dtype="auto", seq_len=calib.seq_len, batch_size=1)
    return held if held.streamed else Residency(streamed=False, batch_size=1)


def _run(
    model: nn.Module, windows: list[list[int]], dev: torch.device, console: Console, label: str, batch: int = 1
) -> None:
    """Every window through ``model``, ``batch`` windows of one length per forward pass (a streamed model reads the
    whole checkpoint once per pass); the hooks count every position of a batch, so no window is padded."""
    by_length: dict[int, list[list[int]]] = {}
    for w in windows:
        by_length.setdefault(len(w), []).append(w)
    with task(console, label, len(windows), unit="windows") as advance:
        for same in by_length.values():
            for i in range(0, len(same), batch):
                rows = same[i : i + batch]
                model(input_ids=torch.tensor(rows, device=dev), use_cache=False)
                advance(len(rows))


def expert_token_table(m: ImportanceMatrix) -> dict[str, dict[str, list[int]]]:
    """Per layer, the tokens each expert saw during calibration: ``routed`` (what the router sent it) and
    ``used`` (the tokens its statistics come from)."""
    routed = (m.info or {}).get("routed_tokens") or {}
    out: dict[str, dict[str, list[int]]] = {}
    for name, used in m.expert_tokens().items():
        if not name.endswith("ffn_gate_exps.weight"):
            continue
        layer = name.split(".")[1]
        out[layer] = {"used": used}
        if name in routed:
            out[layer]["routed"] = routed[name]
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))
