"""The GEM router: P(d|x) = softmax(W_r · e(x) + b) over an encoder, the threshold rule, training and report.

The encoder is the general model's own first layers (``encoder_layers``), frozen; only W_r and b train, by
cross-entropy against the domain a window of text came from (the paper gives no recipe; dataset-of-origin labels
are ours). Token level labels every token of a window with its domain; sequence level mean-pools e over the window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetool.methods.gem.model import GemForCausalLM, decide, rms_features
from moetool.methods.gem.records import RouteDecision, RouterTraining, TauRow, TauTable
from moetool.recipe.gem import GemRecipe, GemRouterSpec
from moetool.train.data import load_source, sample_batch, tokenize_stream

Featurize = Callable[[torch.Tensor], torch.Tensor]  # ids [B, T] -> e [B, T, D]


def hf_encoder(hf: Any, n_layers: int) -> Featurize:
    """Router features from a transformers decoder (llama/mistral/qwen families): its first ``n_layers`` layers.

    Used at sequence level, where the general pathway is a plain checkpoint. ids [B, T] → e [B, T, D].
    """
    inner = hf.model

    @torch.no_grad()
    def featurize(ids: torch.Tensor) -> torch.Tensor:
        x = inner.embed_tokens(ids)
        t = ids.shape[1]
        pos = torch.arange(t)[None]
        pe = inner.rotary_emb(x, pos)
        mask = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        for layer in inner.layers[:n_layers]:
            out = layer(x, attention_mask=mask, position_embeddings=pe, position_ids=pos)
            x = out[0] if isinstance(out, tuple) else out
        return rms_features(x)

    return featurize


def gem_encoder(model: GemForCausalLM) -> Featurize:
    """Router features of a ``moetool_gem`` model (its own encoder pass)."""
    gm = model.model

    @torch.no_grad()
    def featurize(ids: torch.Tensor) -> torch.Tensor:
        x = gm.embed_tokens(ids)
        t = ids.shape[1]
        pe = gm.rotary_emb(x, torch.arange(t)[None])
        causal = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        out: torch.Tensor = gm.encode(x, pe, causal)
        return out

    return featurize


def domain_streams(
    recipe: GemRecipe, tokenizer: PreTrainedTokenizerBase, recipe_dir: Path | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(train ids [N], held-out ids [M]) per domain, from each domain's ``data`` source."""

    out = {}
    for d in recipe.domains:
        train, valid = load_source(d.name, d.data, base_dir=recipe_dir, fraction=0.1, seed=0)
        out[d.name] = (tokenize_stream(tokenizer, train), tokenize_stream(tokenizer, valid))
    return out


def _logits(router: nn.Linear, e: torch.Tensor, pool: bool) -> torch.Tensor:
    """Token level [B, T, n]; sequence level the mean-pooled [B, n]."""
    result: torch.Tensor = router(e.mean(1) if pool else e)
    return result


def train_router(
    router: nn.Linear,
    featurize: Featurize,
    streams: list[torch.Tensor],
    spec: GemRouterSpec,
    *,
    bos_id: int | None,
    pool: bool = False,
    log: Callable[[str], None] | None = None,
) -> RouterTraining:
    """Train ``router`` (only) on windows of each domain's ids as a recipe's ``router`` section says (its steps,
    learning rate, batch, window length and seed); row i of step s comes from domain (s·B + i) mod n.

    The encoder runs under no_grad and nothing else is handed to the optimiser, so every other weight stays
    bit-identical. Returns the loss curve (every 10 steps) and the time taken.
    """

    steps, batch_size = spec.steps, spec.batch_size
    opt = torch.optim.Adam(router.parameters(), lr=spec.learning_rate)
    n = len(streams)
    curve: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    router.train()
    for step in range(steps):
        ids = sample_batch(streams, batch_size, spec.seq_len, seed=spec.seed, step=step, bos_id=bos_id)
        labels = torch.tensor([(step * batch_size + i) % n for i in range(batch_size)])
        e = featurize(ids)
        logits = _logits(router, e, pool)
        target = labels if pool else labels[:, None].expand(ids.shape)
        loss = nn.functional.cross_entropy(logits.reshape(-1, n), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            curve.append((step, loss.item()))
            if log is not None and (step % 50 == 0 or step == steps - 1):
                log(f"router step {step}: loss {loss.item():.4f}")
    router.eval()
    return RouterTraining(steps=steps, loss_curve=curve, seconds=round(time.perf_counter() - t0, 2))


@torch.no_grad()
def held_out_probs(
    router: nn.Linear,
    featurize: Featurize,
    valid: dict[str, torch.Tensor],
    *,
    seq_len: int,
    max_tokens: int,
    bos_id: int | None,
    pool: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """P(d|x) on held-out windows: (probs [N, n], true domain [N]); N tokens (token level) or windows (sequence)."""
    body = seq_len - (1 if bos_id is not None else 0)
    probs, labels = [], []
    for d, stream in enumerate(valid.values()):
        ids = stream[:max_tokens]
        for s in range(0, len(ids) - body + 1, body):
            w = ids[s : s + body]
            if bos_id is not None:
                w = torch.cat([torch.tensor([bos_id]), w])
            p = torch.softmax(_logits(router, featurize(w[None]), pool).float(), -1).reshape(-1, len(valid))
            probs.append(p)
            labels.append(torch.full((p.shape[0],), d))
    if not probs:
        raise ValueError(f"held-out text is shorter than one window of {seq_len} tokens")
    return torch.cat(probs), torch.cat(labels)


def tau_table(probs: torch.Tensor, labels: torch.Tensor, taus: list[float], names: list[str]) -> TauTable:
    """Router quality as tau varies.

    Per tau: ``fallback`` (share sent to general, max P ≤ tau), ``routed_accuracy`` (right domain among those
    routed; NaN → None when none is), ``correct`` (share routed to the right domain), ``wrong`` (share routed to a
    wrong domain), and the fallback share per true domain. ``argmax_accuracy`` ignores the threshold.
    """
    rows = []
    for tau in taus:
        route = decide(probs, tau)
        routed = route > 0
        right = routed & (route - 1 == labels)
        n_routed = int(routed.sum())
        rows.append(
            TauRow(
                tau=tau,
                fallback=round(1 - n_routed / len(labels), 4),
                routed_accuracy=None if n_routed == 0 else round(int(right.sum()) / n_routed, 4),
                correct=round(int(right.sum()) / len(labels), 4),
                wrong=round((n_routed - int(right.sum())) / len(labels), 4),
                fallback_by_domain={
                    n: round(float((~routed[labels == d]).float().mean()), 4) for d, n in enumerate(names)
                },
            )
        )
    acc = float((probs.argmax(-1) == labels).float().mean())
    return TauTable(items=len(labels), argmax_accuracy=round(acc, 4), by_tau=rows)


@torch.no_grad()
def log_decisions(
    model: GemForCausalLM, tokenizer: PreTrainedTokenizerBase, text: str, tau: float | None = None
) -> list[RouteDecision]:
    """Per-token routing decisions of a ``moetool_gem`` model on ``text``: token, pathway, max P and all P."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model(ids, tau=tau)
    names = ["general", *model.config.domains]
    rows = []
    for t in range(ids.shape[1]):
        p = out.router_probs[0, t]
        rows.append(
            RouteDecision(
                pos=t,
                token=str(tokenizer.decode([int(ids[0, t])])),
                route=names[int(out.routes[0, t])],
                max_p=round(float(p.max()), 6),
                probs={d: round(float(x), 6) for d, x in zip(model.config.domains, p, strict=True)},
            )
        )
    return rows
