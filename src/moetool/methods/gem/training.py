"""The token-level GEM model's training stages: SCAR centroids, the router (everything else frozen, checked by
hash), QAT against the domains' experts; and the held-out figures they print."""

from __future__ import annotations

import hashlib
import math

import torch
from rich.console import Console

from moetool.errors import MoetoolError
from moetool.methods.gem.model import GemForCausalLM
from moetool.methods.gem.pathways import Pathways, fit_scar_centroids
from moetool.methods.gem.qat import apply_fake_quant, gem_plan, quant_bits, run_qat, trainable_names
from moetool.methods.gem.records import QatReport, RouterTraining, ScarFit, TauTable
from moetool.methods.gem.router import Featurize, gem_encoder, held_out_probs, tau_table, train_router
from moetool.recipe.gem import GemRecipe
from moetool.train.data import sample_batch


def digest(model: torch.nn.Module, skip: str) -> dict[str, str]:
    """sha256 of every parameter whose name does not start with ``skip`` (to prove they did not move)."""
    return {
        n: hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()
        for n, p in model.named_parameters()
        if not n.startswith(skip)
    }


def held_out_ppl(
    model: torch.nn.Module,
    valid: dict[str, torch.Tensor],
    bos: int | None,
    tokens: int,
    seq_len: int = 128,
) -> dict[str, float]:
    """Perplexity per domain on the first ``tokens`` held-out ids, non-overlapping windows (BOS + seq_len − 1)."""

    out = {}
    body = seq_len - (1 if bos is not None else 0)
    with torch.no_grad():
        for d, stream in valid.items():
            ids = stream[:tokens]
            nll, n = 0.0, 0
            for s in range(0, len(ids) - body + 1, body):
                w = ids[s : s + body]
                w = torch.cat([torch.tensor([bos]), w]) if bos is not None else w
                logits = model(w[None]).logits[0, :-1].float()
                nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
                n += len(w) - 1
            out[d] = round(math.exp(nll / max(n, 1)), 4)
    return out


Streams = dict[str, tuple[torch.Tensor, torch.Tensor]]  # domain → (train ids [N], held-out ids [M])


def fit_scar(model: GemForCausalLM, recipe: GemRecipe, streams: Streams, bos: int | None) -> ScarFit:
    """SCAR's k-means centroids on a calibration batch per domain."""

    calib = [
        sample_batch([s[0]], 4, 128, seed=recipe.router.seed, step=i, bos_id=bos)
        for i, s in enumerate(streams.values())
    ]
    fit_scar_centroids(model, calib, recipe.scar.iterations, seed=recipe.router.seed)
    return ScarFit(clusters=recipe.scar.clusters, fitted_on_tokens=sum(c.numel() for c in calib))


def train_recipe_router(
    router: torch.nn.Linear,
    featurize: Featurize,
    streams: Streams,
    recipe: GemRecipe,
    bos: int | None,
    console: Console,
    *,
    pool: bool = False,
) -> RouterTraining:
    """The router trained on each domain's train stream as the recipe's ``router`` section says."""
    train = [s[0] for s in streams.values()]
    return train_router(router, featurize, train, recipe.router, bos_id=bos, pool=pool, log=console.print)


def train_token_router(
    model: GemForCausalLM, recipe: GemRecipe, streams: Streams, bos: int | None, console: Console
) -> tuple[RouterTraining, TauTable]:
    """Train the router with everything else frozen (checked by hash); its held-out table over τ."""

    before = digest(model, "model.router.")
    router = model.model.router
    for p in model.parameters():
        p.requires_grad_(False)
    router.requires_grad_(True)
    spec = recipe.router
    training = train_recipe_router(router, gem_encoder(model), streams, recipe, bos, console)
    router.requires_grad_(False)
    moved = [n for n, h in digest(model, "model.router.").items() if before[n] != h]
    if moved:
        raise MoetoolError(f"router training changed frozen weights: {moved[:3]}")
    training["frozen_unchanged"] = len(before)
    valid = {d: s[1] for d, s in streams.items()}
    probs, labels = held_out_probs(
        router, gem_encoder(model), valid, seq_len=spec.seq_len, max_tokens=spec.eval_tokens, bos_id=bos
    )
    table = tau_table(probs, labels, spec.tau_grid, list(streams))
    print_tau(console, table)
    return training, table


def token_qat(
    model: GemForCausalLM, recipe: GemRecipe, pw: Pathways, streams: Streams, bos: int | None, console: Console
) -> QatReport:
    """QAT with the domains' experts as teachers; held-out perplexity (float and fake-quantized) before and after,
    printed as labelled lines; weights outside the trainable groups unchanged (checked by hash)."""
    import copy

    from transformers import AutoModelForCausalLM

    bits = quant_bits(gem_plan(model, recipe.quantization, fit_rows=False))
    teachers = {
        d: AutoModelForCausalLM.from_pretrained(str(s.path), dtype=torch.float32).eval() for d, s in pw.domains.items()
    }
    valid = {d: s[1] for d, s in streams.items()}
    ev_tokens = min(4096, recipe.router.eval_tokens)

    def ppl_pair() -> dict[str, dict[str, float]]:
        q = copy.deepcopy(model)
        apply_fake_quant(q, bits)
        return {
            "float": held_out_ppl(model, valid, bos, ev_tokens),
            "fake_quant": held_out_ppl(q, valid, bos, ev_tokens),
        }

    pre = ppl_pair()
    frozen = digest(model, "\0")
    qat = run_qat(
        model, teachers, {d: s[0] for d, s in streams.items()}, recipe.qat, bits, bos_id=bos, log=console.print
    )
    after = digest(model, "\0")
    train_set = set(trainable_names(model, list(recipe.qat.trainable)))
    moved = [n for n in after if after[n] != frozen[n] and n not in train_set]
    if moved:
        raise MoetoolError(f"QAT changed frozen weights: {moved[:3]}")
    post = ppl_pair()
    for label, value in (("before", pre), ("after", post)):
        figures = ", ".join(
            f"{kind} " + " / ".join(f"{d} {v:.2f}" for d, v in by.items()) for kind, by in value.items()
        )
        console.print(f"QAT held-out perplexity {label}: {figures}", highlight=False)
    qat["before"], qat["after"] = pre, post
    qat["frozen_unchanged"] = len(after) - len(train_set)
    qat["eval_tokens_per_domain"] = ev_tokens
    return qat


def print_tau(console: Console, table: TauTable) -> None:
    console.print(f"router held-out argmax accuracy {table['argmax_accuracy']:.3f} over {table['items']} items")
    for row in table["by_tau"]:
        acc = "-" if row["routed_accuracy"] is None else f"{row['routed_accuracy']:.3f}"
        console.print(
            f"  tau {row['tau']:.2f}: fallback {row['fallback']:.3f}, routed accuracy {acc}, "
            f"correct {row['correct']:.3f}, wrong {row['wrong']:.3f}"
        )
