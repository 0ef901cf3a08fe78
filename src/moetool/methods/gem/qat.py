"""Quantization-aware tuning of the token-level GEM model and its hybrid-precision plan by role.

L = L_task + λq · Σ_W ‖W − Q(W)‖² + λkd · L_kd  (GEM's "QAKP" loss; defaults 0.1 and 0.5)

- L_task: next-token cross-entropy on the domain's text, the model routing as it will at inference.
- Q(W): symmetric blockwise round-to-nearest (32 weights per block, absmax scale) at the nominal bits of W's type in
  the recipe's quantization plan (gem preset: pathways 4, router 6, general 8; f32/f16 tensors are not penalised).
  It stands in for GGUF's k-quants, which have no differentiable reference in torch. Q(W) is a constant target, so
  the penalty's gradient 2(W − Q(W)) pulls each weight towards its grid point.
- L_kd: T² · KL(softmax(teacher/T) ‖ softmax(student/T)); the teacher is the domain's own expert on its text (the
  paper defines neither L_kd nor T; T = 2 is ours).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from moetool.methods.gem.records import QatReport, QatStep
from moetool.quant.plan import QuantPlan, QuantSpec, TensorEntry, resolve
from moetool.quant.roles import Role, role_of
from moetool.quant.types import get_type
from moetool.train.data import sample_batch

if TYPE_CHECKING:
    from moetool.methods.gem.model import GemForCausalLM
    from moetool.recipe.gem import GemQATSpec

BLOCK = 32


def gem_role(name: str) -> Role:
    """Role of a ``moetool_gem`` parameter: pathways are the 'experts' role, the router and SCAR centroids 'router',
    the general FFN 'ffn'; the rest as for any checkpoint."""
    if ".mlp.pathways." in name:
        return "experts"
    if name.startswith("model.router.") or name.startswith("model.scar_centroids"):
        return "router"
    return role_of(name)


def gem_entries(model: nn.Module) -> list[TensorEntry]:
    """One plan entry per (deduplicated: tied embeddings once) parameter."""
    return [TensorEntry(n, tuple(p.shape), role=gem_role(n)) for n, p in model.named_parameters()]


def gem_plan(model: nn.Module, spec: QuantSpec, *, fit_rows: bool = True) -> QuantPlan:
    """The hybrid plan over the GEM model's tensors. ``fit_rows``: apply GGUF's block fallbacks (q4_k → q5_0,
    q6_k → q8_0 on rows 256 does not divide), as the memory estimate does; QAT uses the nominal role map
    (``fit_rows=False``: pathways 4, router 6, general 8 bits), which is also what the graph targets store."""
    return resolve(spec, gem_entries(model), fit_rows=fit_rows)


def quant_bits(plan: QuantPlan) -> dict[str, int]:
    """Parameter name → nominal bits of its planned type, for quantized (non-float) 2-D+ tensors only."""
    out = {}
    for a in plan.assignments:
        t = get_type(a.type)
        if not t.is_float and len(a.entry.shape) >= 2:
            out[a.entry.hf_name] = t.bits
    return out


def fake_quant(w: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """Q(W): symmetric round-to-nearest per block of ``block`` consecutive weights along the last dim (padded with
    zeros when it does not divide), levels −2^(b−1)…2^(b−1)−1 times absmax/(2^(b−1)−1). Same shape as ``w``."""
    flat = w.reshape(-1, w.shape[-1])
    pad = (-flat.shape[1]) % block
    if pad:
        flat = nn.functional.pad(flat, (0, pad))
    blocks = flat.reshape(flat.shape[0], -1, block)
    qmax = 2 ** (bits - 1) - 1
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / qmax
    q = (blocks / scale).round().clamp(-qmax - 1, qmax) * scale
    result: torch.Tensor = q.reshape(flat.shape)[:, : w.shape[-1]].reshape(w.shape)
    return result


def quant_penalty(params: dict[str, nn.Parameter], bits: dict[str, int]) -> torch.Tensor:
    """Σ ‖W − Q(W)‖² over the given parameters that the plan quantizes (Q(W) a constant)."""
    total = torch.zeros(())
    for name, p in params.items():
        if name in bits:
            total = total + (p - fake_quant(p.detach(), bits[name])).pow(2).sum()
    return total


@torch.no_grad()
def apply_fake_quant(model: nn.Module, bits: dict[str, int]) -> None:
    """Replace every planned weight by Q(W) in place (to measure what the hybrid plan costs)."""
    for name, p in model.named_parameters():
        if name in bits:
            p.copy_(fake_quant(p, bits[name]))


_GROUPS: dict[str, Callable[[str], bool]] = {
    "pathways": lambda n: ".mlp.pathways." in n,
    "general_ffn": lambda n: ".mlp." in n and ".pathways." not in n,
    "attention": lambda n: ".self_attn." in n,
}


def trainable_names(model: nn.Module, groups: list[str]) -> list[str]:
    return [n for n, _ in model.named_parameters() if any(_GROUPS[g](n) for g in groups)]


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T² · KL(p_teacher ‖ p_student) at temperature T, mean over tokens; logits [B, T, V]."""
    s = nn.functional.log_softmax(student.float() / temperature, -1)
    t = nn.functional.log_softmax(teacher.float() / temperature, -1)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature**2


def run_qat(
    model: GemForCausalLM,
    teachers: Mapping[str, nn.Module],
    streams: dict[str, torch.Tensor],
    spec: GemQATSpec,
    bits: dict[str, int],
    *,
    bos_id: int | None,
    log: Callable[[str], None] | None = None,
) -> QatReport:
    """Tune the parameters of ``spec.trainable`` with the QAKP loss; step s draws a batch of domain s mod n and
    distils from that domain's expert. Everything not trainable is frozen (requires_grad False, not in the optimiser).

    Returns per-step loss terms (every 5 steps) and the time taken.
    """

    names = set(trainable_names(model, list(spec.trainable)))
    params = {}
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
        if n in names:
            params[n] = p
    opt = torch.optim.AdamW(params.values(), lr=spec.learning_rate, weight_decay=0.0)
    domains = list(streams)
    curve = []
    t0 = time.perf_counter()
    model.train()
    for step in range(spec.steps):
        d = domains[step % len(domains)]
        ids = sample_batch([streams[d]], spec.batch_size, spec.seq_len, seed=spec.seed, step=step, bos_id=bos_id)
        out = model(ids, labels=ids)
        with torch.no_grad():
            t_logits = teachers[d](ids).logits
        l_kd = kd_loss(out.logits, t_logits, spec.temperature)
        l_q = quant_penalty(params, bits)
        loss = out.loss + spec.lambda_q * l_q + spec.lambda_kd * l_kd
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == spec.steps - 1:
            row = QatStep(
                step=step, domain=d, task=out.loss.item(), quant=l_q.item(), kd=l_kd.item(), total=loss.item()
            )
            curve.append(row)
            if log is not None:
                log(f"qat step {step} ({d}): task {row['task']:.4f} quant {row['quant']:.4f} kd {row['kd']:.4f}")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return QatReport(
        steps=spec.steps,
        trainable=sorted(spec.trainable),
        trainable_params=sum(p.numel() for p in params.values()),
        curve=curve,
        seconds=round(time.perf_counter() - t0, 2),
    )
