"""The training loop moetool's own small models share: AdamW steps with clipping and a schedule, and the causal-LM
pre-training loop of the zoo's models (its Transformers and its Mamba) on balanced windows of per-domain streams.

:func:`optimise` is the step loop itself (zero grads, loss, backward, clip, step, schedule) for any loss;
:func:`train_lm` is the zoo's recipe on top of it. Same config, seed and thread count on the same machine give
the same weights.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetool.errors import MoetoolError

__all__ = ["LoopConfig", "decay_groups", "derive_seed", "optimise", "sample_windows", "train_lm", "warmup_cosine"]

Advance = Callable[..., None]  # ``advance(n=1, note="")``, as :func:`moetool.progress.task` yields


@dataclass(frozen=True)
class LoopConfig:
    """What :func:`train_lm` reads besides the model, data, step count and learning rate; the configs of the
    models trained with it (the zoo's, its Mamba's) extend it."""

    seq_len: int = 256
    batch_size: int = 8
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    seed: int = 0


def derive_seed(seed: int, name: str) -> int:
    """A seed of its own for each named stream of randomness (``data:code``, ``expert:legal``) from one base seed."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def warmup_cosine(steps: int, warmup_fraction: float, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` (a multiplier of the peak learning rate)."""
    warmup = max(1, round(steps * warmup_fraction))

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return fn


def sample_windows(
    streams: list[torch.Tensor], domains: list[int], seq_len: int, bos_id: int, gen: torch.Generator
) -> torch.Tensor:
    """``[len(domains), seq_len]`` windows: ``<s>`` + ``seq_len - 1`` contiguous tokens of each row's stream."""
    span = seq_len - 1
    rows = []
    for d in domains:
        stream = streams[d]
        start = int(torch.randint(0, stream.numel() - span + 1, (1,), generator=gen))
        rows.append(stream[start : start + span])
    body = torch.stack(rows)
    bos = torch.full((body.size(0), 1), bos_id, dtype=torch.long)
    return torch.cat([bos, body], dim=1)


def decay_groups(
    params: list[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, list[torch.nn.Parameter] | float]]:
    """AdamW groups: matrices decay, embeddings, norms and biases do not."""
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    groups: list[dict[str, list[torch.nn.Parameter] | float]] = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optimise(
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    params: list[torch.nn.Parameter],
    steps: int,
    step_loss: Callable[[int], torch.Tensor],
    *,
    max_grad_norm: float = 1.0,
    after_step: Callable[[int, float], None] | None = None,
) -> float:
    """``steps`` optimiser steps, step ``i`` on ``step_loss(i)`` (a scalar tensor); gradients of ``params`` are
    clipped to ``max_grad_norm``. ``after_step(i, loss)`` sees every step's loss (logging, divergence checks).

    Returns the last step's loss (nan for no steps). Gradients are released afterwards.
    """
    loss_value = float("nan")
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = step_loss(i)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if after_step is not None:
            after_step(i, loss_value)
    opt.zero_grad(set_to_none=True)  # a model copied after training (the zoo's experts) carries no stale gradients
    return loss_value


def train_lm(
    model: torch.nn.Module,
    *,
    name: str,
    streams: list[torch.Tensor],
    mix: list[int],
    steps: int,
    lr: float,
    cfg: LoopConfig,
    bos_id: int,
    advance: Advance | None = None,
) -> dict[str, float]:
    """Train ``model`` in place for ``steps`` steps on windows from ``streams[d]`` (token streams ``[N_d]``) for
    ``d`` in ``mix``; row ``r`` of step ``s`` comes from ``mix[(r + s) % len(mix)]`` (a balanced mix).

    AdamW (β 0.9/0.95, decay on matrices only), warmup then cosine decay, gradients clipped to 1. ``advance``
    (e.g. from :func:`moetool.progress.task`) is called once a step with the loss and throughput.

    Returns:
        steps, seconds, tokens, tokens_per_second, final_loss, final_loss_ema, trainable_parameters.

    Raises:
        MoetoolError: the loss is not finite (training diverged).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in params]
    opt = torch.optim.AdamW(decay_groups(params, cfg.weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, cfg.warmup_fraction, cfg.min_lr_ratio))
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, f"data:{name}"))
    tokens_per_step = cfg.batch_size * (cfg.seq_len - 1)
    ema: float | None = None  # the smoothed loss, once there is one

    def batch_loss(step: int) -> torch.Tensor:
        rows = [mix[(r + step) % len(mix)] for r in range(cfg.batch_size)]
        batch = sample_windows(streams, rows, cfg.seq_len, bos_id, gen)  # [B, seq_len]
        loss: torch.Tensor = model(input_ids=batch, labels=batch).loss
        return loss

    def after_step(step: int, loss: float) -> None:
        nonlocal ema
        if not math.isfinite(loss):
            raise MoetoolError(f"training of zoo model {name!r} diverged at step {step} (loss {loss})")
        ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        if advance is not None:
            tps = (step + 1) * tokens_per_step / max(time.perf_counter() - t0, 1e-9)
            advance(1, f"loss {ema:.3f}, {tps:.0f} tok/s")

    model.train()
    t0 = time.perf_counter()
    last = optimise(opt, sched, trainable, steps, batch_loss, after_step=after_step)
    seconds = time.perf_counter() - t0
    model.eval()
    return {
        "steps": steps,
        "seconds": round(seconds, 2),
        "tokens": steps * tokens_per_step,
        "tokens_per_second": round(steps * tokens_per_step / max(seconds, 1e-9), 1),
        "final_loss": round(last, 4),
        "final_loss_ema": round(ema if ema is not None else float("nan"), 4),
        "trainable_parameters": sum(p.numel() for p in trainable),
    }
