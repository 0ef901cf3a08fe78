"""Retrofit a routed embedding onto an existing causal LM, then train it with the body frozen.

Initialisation (so training starts from the best low-rank copy of the old table, not from noise):

- ``E ≈ U_r Σ_r V_rᵀ`` (truncated SVD of the old embedding E [V, D]); the seed table holds ``a_x = U_r Σ_r`` rows
  (scaled to unit RMS) and the projection ``V_r`` (scaled back), so ``table @ projᵀ`` is the rank-r approximation.
- ``generative`` runs the seed through ``LayerNorm`` first, which would remove each row's mean and norm. Its table
  therefore stores every row on the LayerNorm's fixed point: ``z_x = Q(α a_x) + f_x q`` with Q an isometry into the
  zero-mean subspace, q a unit zero-mean direction orthogonal to Q's range and ``f_x = sqrt(d - ‖α a_x‖²)``, so
  ``mean(z_x) = 0`` and ``‖z_x‖² = d``: ``LayerNorm(z_x) = z_x / sqrt(1 + eps)``. The projection reads Q's
  coordinates only (q maps to 0). With the generator's last layer at zero the step-0 output is exactly the rank
  ``d - 2`` SVD approximation (two seed dims go to the mean and the norm).
- ``selection``'s pool rows repeat the seed row (×2, since every mask starts at 0.5); ``remix`` starts near it
  (softmax rows cannot be exactly one-hot; see ``remix_diag``); ``dense`` is exact.

Training (``train_embedding``): the body (and a ``keep`` head) frozen, loss = ``lm · LM + distill · ‖h - E[x]‖² /
mean ‖E[x]‖² + aux``, AdamW with warmup and cosine decay; then optionally ``unfreeze_steps`` with everything trainable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from moetool.methods.embedding.model import RoutedEmbeddingConfig, RoutedEmbeddingForCausalLM
from moetool.methods.embedding.router import causal_mask
from moetool.methods.embedding.variants import EmbeddingArgs, EmbeddingConfig
from moetool.recipe.embedding import RetrofitTrainSpec
from moetool.train.loop import optimise

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def svd_seed(
    weight: torch.Tensor,
    d: int,
    *,
    on_layernorm_sphere: bool,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Seed table [V, d] and projection weight [D, d] with ``LN?(table) @ projᵀ`` = the rank-r SVD approximation.

    Returns (table, proj_weight, r): r = d, or d - 2 ``on_layernorm_sphere`` (see the module docstring).
    """
    e = weight.detach().double()
    v_, dm = e.shape
    r = d - 2 if on_layernorm_sphere else d
    if r < 1 or r > min(v_, dm):
        raise ValueError(f"seed_dim {d} gives SVD rank {r}, which must be between 1 and {min(v_, dm)}")
    u, s, vh = torch.linalg.svd(e, full_matrices=False)
    a = u[:, :r] * s[:r]  # [V, r]
    b = vh[:r]  # [r, D]
    if not on_layernorm_sphere:
        scale = a.pow(2).mean().sqrt().clamp_min(1e-12)  # unit RMS entries: the router and remix see O(1) inputs
        return (a / scale).float(), (b.T * scale).float(), r
    alpha = math.sqrt(d / 2) / a.norm(dim=1).max().clamp_min(1e-12)  # every row inside the sphere, f ≥ sqrt(d/2)
    basis = torch.linalg.qr(torch.eye(d, dtype=torch.float64) - 1.0 / d)[0]  # columns span the zero-mean subspace
    # the first d-1 columns of QR(I - 11ᵀ/d) are orthonormal and zero-mean
    q_range, q_fill = basis[:, :r], basis[:, r]  # [d, r], [d]
    a = a * alpha
    f = (d - a.pow(2).sum(1)).clamp_min(0).sqrt()  # [V]
    table = a @ q_range.T + f[:, None] * q_fill  # [V, d]; mean 0, norm² d
    proj = (q_range @ b).T * (math.sqrt(1 + eps) / alpha)  # [D, d]; z/sqrt(1+eps) @ projᵀ = a_original @ b
    return table.float(), proj.float(), r


def table_of(embedding: torch.nn.Module) -> torch.Tensor:
    """The weight ``[V, D]`` of an input embedding or output head, detached, in float32 (not a copy when it is)."""
    weight = embedding.weight
    assert isinstance(weight, torch.Tensor)
    return weight.detach().float()


def retrofit(source: PreTrainedModel, embedding: EmbeddingArgs, *, head: str = "keep") -> RoutedEmbeddingForCausalLM:
    """A routed-embedding model around ``source``'s body (a loaded transformers causal LM), initialised from its
    embedding as the module docstring says. ``embedding``: :class:`EmbeddingConfig` fields except vocab/d_model."""
    cfg = source.config
    body = cfg.to_dict()
    args = EmbeddingArgs(max_positions=int(getattr(cfg, "max_position_embeddings", 512)))
    args.update(embedding)
    ecfg = EmbeddingConfig(vocab_size=cfg.vocab_size, d_model=cfg.hidden_size, **args)
    model = RoutedEmbeddingForCausalLM(RoutedEmbeddingConfig(body=body, embedding=ecfg.to_dict(), head=head))
    state = {k.removeprefix(f"{source.base_model_prefix}."): v for k, v in source.state_dict().items()}
    body_state = {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    missing, unexpected = model.body.load_state_dict(body_state, strict=False)
    if missing or unexpected:
        raise ValueError(f"body weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    old = table_of(source.get_input_embeddings())
    if model.lm_head is not None:
        model.lm_head.weight.data.copy_(table_of(source.get_output_embeddings()))
    init_from_embedding(model, old)
    return model


@torch.no_grad()
def init_from_embedding(model: RoutedEmbeddingForCausalLM, old: torch.Tensor) -> int:
    """Seed table, projection (and selection's pool) from the SVD of ``old`` [V, D]; returns the SVD rank."""
    emb = model.embed
    cfg = emb.cfg
    table, proj, r = svd_seed(old, cfg.seed_dim, on_layernorm_sphere=cfg.variant == "generative", eps=cfg.ln_eps)
    emb.proj.weight.copy_(proj)
    if cfg.variant == "selection":
        emb.table.weight.copy_(2 * table.repeat_interleave(cfg.pool_dim // cfg.seed_dim, dim=1))
    else:
        emb.table.weight.copy_(table)
    return r


class TrainSettings(RetrofitTrainSpec):
    """A recipe's ``train:`` section (its fields and defaults) and how often the run logs its loss; ``history``
    collects those ``{"step", "loss"}`` points as it trains (``data`` is not read here)."""

    log_every: int = Field(default=50, ge=1)
    history: list[dict[str, float]] = Field(default_factory=list)

    @classmethod
    def of(cls, spec: RetrofitTrainSpec) -> TrainSettings:
        """The settings a recipe's ``train:`` section gives (logging at the default interval)."""
        return cls(**dict(spec))


def _schedule(steps: int, warmup: int) -> Callable[[int], float]:
    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))

    return fn


def _phase(
    model: RoutedEmbeddingForCausalLM,
    params: list[torch.nn.Parameter],
    steps: int,
    lr: float,
    batches: Callable[[int], torch.Tensor],
    teacher: torch.Tensor,
    s: TrainSettings,
    offset: int,
    log: Callable[[str], None] | None,
) -> None:
    if steps <= 0:
        return
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(steps, min(s.warmup_steps, steps // 2)))
    norm = teacher.pow(2).sum(-1).mean()

    def step_loss(i: int) -> torch.Tensor:
        ids = batches(offset + i)  # [B, T]
        b, t = ids.shape
        if s.lm_weight:
            out = model(ids, labels=ids)
            h, loss = out["embeds"], s.lm_weight * out.loss + out["aux_loss"]
        else:
            pos = torch.arange(t)[None].expand(b, t)
            h, _, aux = model.embed(ids, pos, causal_mask(t, 0, b))
            loss = aux["total"]
        if s.distill_weight:
            loss = loss + s.distill_weight * (h - teacher[ids]).pow(2).sum(-1).mean() / norm
        result: torch.Tensor = loss
        return result

    def after_step(i: int, loss: float) -> None:
        if (offset + i + 1) % s.log_every == 0:
            s.history.append({"step": offset + i + 1, "loss": loss})
            if log:
                log(f"step {offset + i + 1}: loss {loss:.4f}")

    model.train()
    optimise(opt, sched, params, steps, step_loss, max_grad_norm=s.max_grad_norm, after_step=after_step)
    model.eval()


def train_embedding(
    model: RoutedEmbeddingForCausalLM,
    teacher: torch.Tensor,
    batches: Callable[[int], torch.Tensor],
    s: TrainSettings,
    log: Callable[[str], None] | None = None,
) -> float:
    """Train ``model.embed`` (and a ``seed`` head through it) with the body frozen, then optionally everything.

    Args:
        teacher: the old embedding table [V, D] (distillation target ``E[x]``).
        batches: step → ids [B, T] (a pure function of the step, see ``moetool.train.data.sample_batch``).

    Returns:
        Seconds spent.
    """
    t0 = time.perf_counter()
    torch.manual_seed(s.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.embed.parameters():
        p.requires_grad_(True)
    emb_params = [p for p in model.parameters() if p.requires_grad]
    _phase(model, emb_params, s.steps, s.learning_rate, batches, teacher, s, 0, log)
    if s.unfreeze_steps:
        for p in model.parameters():
            p.requires_grad_(True)
        _phase(
            model,
            list(model.parameters()),
            s.unfreeze_steps,
            s.unfreeze_learning_rate,
            batches,
            teacher,
            s,
            s.steps,
            log,
        )
    for p in model.parameters():
        p.requires_grad_(False)
    return time.perf_counter() - t0
