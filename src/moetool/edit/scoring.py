"""What each expert does on calibration text: routing counts, gate mass and REAP saliency, per MoE layer.

REAP (arXiv 2510.13999) scores expert ``j`` by the mean, over the tokens routed to it, of its gate weight times the
L2 norm of its output: ``S_j = mean_{x routed to j} g_j(x) · ||f_j(x)||``. Frequency is the share of tokens whose
top-k holds ``j``. Both are read from forward hooks on every MoE layer's experts module, which receives the router's
own choice (``top_k_index``, ``top_k_weights``), so the figures are the architecture's routing, renormalisation
included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moetool.edit.layout import EditError, require_tokenizer
from moetool.eval.perplexity import load_causal_lm, text_windows
from moetool.io.jsontypes import JsonObject
from moetool.progress import silent, task
from moetool.routing.tap import FusedExperts, expert_activation, experts_modules

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class ExpertStats:
    """Per MoE layer and expert, over ``tokens`` calibration tokens (each layer sees every token).

    Attributes:
        counts: ``[L, E]`` tokens whose top-k holds the expert.
        gate: ``[L, E]`` summed routing weight.
        reap: ``[L, E]`` summed gate weight × expert output norm.
        domains: per calibration text, its ``counts`` (``[L, E]``) and token count.
    """

    layers: list[int]
    names: list[str]
    top_k: int
    tokens: int
    counts: torch.Tensor
    gate: torch.Tensor
    reap: torch.Tensor
    domains: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def share(self) -> torch.Tensor:
        """``[L, E]`` each expert's share of the layer's top-k slots (a row sums to 1)."""
        return self.counts / max(1, self.tokens * self.top_k)

    def saliency(self) -> torch.Tensor:
        """``[L, E]`` REAP saliency; 0 for an expert no token reached."""
        return self.reap / self.counts.clamp_min(1)

    def to_json(self) -> JsonObject:
        """Plain figures per layer (for ``moetool.json`` and ``--json``)."""
        return {
            "tokens": self.tokens,
            "top_k": self.top_k,
            "experts": list(self.names),
            "layers": {
                str(layer): {
                    "share": [round(float(x), 6) for x in self.share()[i]],
                    "reap": [round(float(x), 6) for x in self.saliency()[i]],
                }
                for i, layer in enumerate(self.layers)
            },
            "domains": {
                d: {
                    "tokens": n,
                    "share": [round(float(x), 6) for x in (c.sum(0) / max(1, n * self.top_k * len(self.layers)))],
                }
                for d, (c, n) in self.domains.items()
            },
        }


class _Hooks:
    """Forward hooks on each MoE layer's experts module, accumulating :class:`ExpertStats` sums."""

    def __init__(self, model: torch.nn.Module, n_experts: int, reap: bool) -> None:
        modules = experts_modules(model)
        self.layers = list(modules)
        n = len(self.layers)
        self.counts = torch.zeros(n, n_experts, dtype=torch.float64)
        self.gate = torch.zeros(n, n_experts, dtype=torch.float64)
        self.reap = torch.zeros(n, n_experts, dtype=torch.float64)
        self.with_reap = reap
        self.handles = [
            modules[layer].register_forward_hook(self._hook(i, modules[layer])) for i, layer in enumerate(self.layers)
        ]

    def _hook(
        self, row: int, module: FusedExperts
    ) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], object], None]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], _output: object) -> None:
            hidden, index, weights = args[0], args[1], args[2]
            for e in range(self.counts.shape[1]):
                token, slot = torch.where(index == e)
                if token.numel() == 0:
                    continue
                w = weights[token, slot].float()
                self.counts[row, e] += token.numel()
                self.gate[row, e] += float(w.sum())
                if self.with_reap:
                    out = F.linear(expert_activation(module, e, hidden[token]), module.down_proj[e])
                    self.reap[row, e] += float((w * out.float().norm(dim=-1)).sum())

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def expert_stats(
    path: Path,
    texts: Mapping[str, str],
    *,
    names: list[str],
    seq_len: int = 256,
    max_tokens: int = 16384,
    reap: bool = True,
    dtype: str | None = None,
    device: str | None = None,
    console: Console | None = None,
) -> ExpertStats:
    """Run the MoE at ``path`` over each text (its first ``max_tokens`` tokens, in windows of ``seq_len``).

    Raises:
        EditError: no text gave a window, or the model has no MoE layers.
    """
    console = console if console is not None else silent()
    require_tokenizer(path, "calibration on text")
    model, tok = load_causal_lm(path, dtype=dtype or "auto", device=device or "auto")
    n_experts = len(names)
    hooks = _Hooks(model, n_experts, reap)
    if not hooks.layers:
        hooks.remove()
        raise EditError(f"{path}: no MoE layer with an experts module")
    dev = next(model.parameters()).device
    domains: dict[str, tuple[torch.Tensor, int]] = {}
    windows = {
        # a character budget first (tokens average a few characters, so 32 each leaves a wide margin): a domain's
        # whole training text is megabytes, of which calibration reads max_tokens
        d: text_windows(
            tok(t[: max_tokens * 32], add_special_tokens=False)["input_ids"][:max_tokens], seq_len, tok.bos_token_id
        )
        for d, t in texts.items()
    }
    total = sum(len(w) for w in windows.values())
    if total == 0:
        hooks.remove()
        raise EditError("the calibration text is empty: give --data a file with text")
    tokens = 0
    try:
        with task(console, "calibration", total, unit="windows") as advance:
            for d, wins in windows.items():
                before, seen = hooks.counts.clone(), 0
                for w in wins:
                    model(input_ids=torch.tensor([w], device=dev), use_cache=False)
                    seen += len(w)
                    advance()
                domains[d] = (hooks.counts - before, seen)
                tokens += seen
    finally:
        hooks.remove()
    return ExpertStats(
        hooks.layers,
        names,
        int(model.config.num_experts_per_tok),
        tokens,
        hooks.counts,
        hooks.gate,
        hooks.reap,
        domains,
    )
