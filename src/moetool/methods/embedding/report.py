"""Parameters saved against quality, measured against fair baselines.

Every arm replaces the input embedding of the same frozen body (the original output head kept and frozen, so only
the input side differs), starts from the same SVD retrofit, and trains with the same budget (steps, batch, loss) and
the same learning-rate sweep. The learning rate of each arm is chosen on one half of the held-out tokens
(``select``) and perplexity is reported on the other half (``test``), so the sweep cannot flatter any arm.

Arms (``default_arms``): the routed variants, a dense factorised table with the *same parameter count* as the
generative arm, a dense table of the same seed width with the router's *depth* (the same causal blocks, no queries,
no routing), the plain same-width table, and the full-width table trained the same way (what training alone gives).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moetool.errors import MoetoolError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import torch

from moetool.methods.embedding.assemble import load_source_model
from moetool.methods.embedding.retrofit import TrainSettings, retrofit, table_of, train_embedding
from moetool.methods.embedding.variants import (
    EmbeddingArgs,
    EmbeddingConfig,
    dense_dim_for_budget,
    measured_counts,
    param_counts,
)
from moetool.train.data import sample_batch, tokenize_stream
from moetool.zoo import DOMAINS, zoo_domain_text

ROUTER = {"width": 64, "layers": 2, "heads": 8, "ff_mult": 2, "n_queries": 8}


class Run(TypedDict):
    """One arm trained at one learning rate: its select-half perplexity (the mean), test-half perplexities per
    domain (and ``mean``), the time and the loss history."""

    select: float
    test: dict[str, float]
    train_seconds: float
    history: list[dict[str, float]]


class _ArmBase(TypedDict):
    embedding: EmbeddingArgs
    params: dict[str, int]
    step0: dict[str, float]
    runs: dict[str, Run]  # keyed by the learning rate as str(lr)


class Arm(_ArmBase, total=False):
    """One arm: what it is, its parameters, step-0 and per-rate figures; the best rate and its test figures."""

    best_lr: float
    test: dict[str, float]


class Settings(TypedDict):
    steps: int
    batch_size: int
    seq_len: int
    learning_rates: list[float]
    lm_weight: float
    distill_weight: float
    seed: int
    eval_tokens_per_domain: int
    threads: int


class HeadFacts(TypedDict):
    choice: str
    params: int
    tied_in_original: bool


class _ReportBase(TypedDict):
    model: str
    vocab: int
    hidden: int
    body_params: int
    original_table: int
    head: HeadFacts


class Report(_ReportBase, total=False):
    """``report.json`` of ``moetool embedding report``: the model's facts, the settings, the original model's
    perplexities, every arm, the time and the verdict."""

    settings: Settings
    original: dict[str, dict[str, float]]
    arms: dict[str, Arm]
    seconds: float
    verdict: str


def default_arms(vocab: int, d_model: int, seed_dim: int = 32, max_positions: int = 512) -> dict[str, EmbeddingArgs]:
    """Arm name → embedding kwargs. The params-matched dense width is computed from the generative arm's count."""
    gen = EmbeddingArgs(variant="generative", seed_dim=seed_dim, router=ROUTER)
    try:
        sized = EmbeddingArgs(max_positions=max_positions) | gen
        budget = param_counts(EmbeddingConfig(vocab_size=vocab, d_model=d_model, **sized))
    except ValueError as exc:  # a table too small for the report's fixed router and seed width
        raise MoetoolError(
            f"embedding report: a {vocab}×{d_model} embedding table is too small for its arms: {exc}"
        ) from None
    dense_dim = dense_dim_for_budget(budget["total"], vocab, d_model)
    if not 1 <= dense_dim <= d_model or seed_dim > d_model:
        raise MoetoolError(
            f"embedding report: a {vocab}×{d_model} embedding table is too small for the report's arms (seed width "
            f"{seed_dim}, params-matched dense width {dense_dim}, both at most the hidden size {d_model}); use a model "
            "with a wider embedding"
        )
    return {
        "generative": gen,
        "remix": EmbeddingArgs(variant="remix", seed_dim=seed_dim, n_experts=4, top_k=4, router=ROUTER),
        "dense-same-params": EmbeddingArgs(variant="dense", seed_dim=dense_dim),
        "dense-same-depth": EmbeddingArgs(variant="dense", seed_dim=seed_dim, depth=ROUTER["layers"], router=ROUTER),
        "dense-same-width": EmbeddingArgs(variant="dense", seed_dim=seed_dim),
        "dense-full-width": EmbeddingArgs(variant="dense", seed_dim=d_model),
    }


def windows_of(ids: torch.Tensor, seq_len: int, bos: int | None, limit: int) -> torch.Tensor:
    """Non-overlapping windows [N, seq_len] of the first ``limit`` tokens, BOS first when the tokenizer has one."""
    body = seq_len - (1 if bos is not None else 0)
    n = min(limit, len(ids)) // body
    w = ids[: n * body].reshape(n, body)
    if bos is not None:
        w = torch.cat([torch.full((n, 1), bos, dtype=w.dtype), w], dim=1)
    return w


@torch.no_grad()
def window_perplexity(model: PreTrainedModel, windows: torch.Tensor, batch: int = 16) -> float:
    """exp(mean next-token NLL) over every content token of ``windows`` [N, T]."""
    model.eval()
    nll, n = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(x).logits[:, :-1].float()
        nll += float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
        )
        n += x[:, 1:].numel()
    return math.exp(nll / n)


def domain_perplexity(model: PreTrainedModel, split: dict[str, torch.Tensor]) -> dict[str, float]:
    """Perplexity per domain of ``split`` (domain → windows [N, T]) and their geometric mean as ``mean``."""
    per = {dm: window_perplexity(model, w) for dm, w in split.items()}
    per["mean"] = math.exp(sum(math.log(p) for p in per.values()) / len(per))
    return per


@dataclass
class _Corpus:
    """The zoo's text as every arm sees it: one training stream and two disjoint held-out halves."""

    batches: Callable[[int], torch.Tensor]  # step → training ids [batch_size, seq_len], the same for every arm
    select: dict[str, torch.Tensor]  # domain → windows [N, seq_len] that choose each arm's learning rate
    test: dict[str, torch.Tensor]  # domain → windows [N, seq_len] for the reported figure


def _zoo_corpus(tok: PreTrainedTokenizerBase, *, batch_size: int, seq_len: int, eval_tokens: int, seed: int) -> _Corpus:
    """Training batches over the zoo's three domains; each domain's validation text split in halves."""

    bos = getattr(tok, "bos_token_id", None)
    streams = [tokenize_stream(tok, zoo_domain_text(dm, "train")) for dm in DOMAINS]
    select, test = {}, {}
    for dm in DOMAINS:
        ids = tokenize_stream(tok, zoo_domain_text(dm, "valid"))
        half = len(ids) // 2
        select[dm] = windows_of(ids[:half], seq_len, bos, eval_tokens)
        test[dm] = windows_of(ids[half:], seq_len, bos, eval_tokens)

    def batches(step: int) -> torch.Tensor:
        return sample_batch(streams, batch_size, seq_len, seed=seed, step=step, bos_id=bos)

    return _Corpus(batches, select, test)


def _model_facts(model_ref: str, source: PreTrainedModel) -> Report:
    """The report's header: what the arms replace (the input table) and keep (the body and the frozen head)."""
    cfg = source.config
    v, d = int(cfg.vocab_size), int(cfg.hidden_size)
    body = sum(p.numel() for n, p in source.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    return Report(
        model=model_ref,
        vocab=v,
        hidden=d,
        body_params=body,
        original_table=v * d,
        head=HeadFacts(
            choice="keep (the original head, frozen)",
            params=v * d,
            tied_in_original=bool(getattr(cfg, "tie_word_embeddings", False)),
        ),
    )


def _run_arm(
    name: str,
    embedding: EmbeddingArgs,
    source: PreTrainedModel,
    teacher: torch.Tensor,
    corpus: _Corpus,
    learning_rates: tuple[float, ...],
    template: TrainSettings,
    log: Callable[[str], None] | None,
) -> Arm:
    """Train one arm from the same retrofit at every learning rate; the rate with the best ``select`` perplexity
    gives the arm's reported ``test`` figure. ``teacher`` [vocab, hidden]: the original table, distilled from."""
    torch.manual_seed(template.seed)
    model = retrofit(source, embedding, head="keep").eval()
    init_state = {k: t.clone() for k, t in model.embed.state_dict().items()}
    arm = Arm(
        embedding=embedding,
        params=measured_counts(model.embed),
        step0=domain_perplexity(model, corpus.test),
        runs={},
    )
    for lr in learning_rates:
        model.embed.load_state_dict(init_state)
        s = template.model_copy(update={"learning_rate": lr, "history": []})
        secs = train_embedding(model, teacher, corpus.batches, s)
        run = Run(
            select=domain_perplexity(model, corpus.select)["mean"],
            test=domain_perplexity(model, corpus.test),
            train_seconds=round(secs, 1),
            history=s.history,
        )
        arm["runs"][str(lr)] = run
        if log:
            log(f"{name} lr {lr:g}: select {run['select']:.2f}, test {run['test']['mean']:.2f} ({secs:.0f}s)")
    best = min(arm["runs"], key=lambda k: arm["runs"][k]["select"])
    arm["best_lr"] = float(best)
    arm["test"] = arm["runs"][best]["test"]
    return arm


def run_report(
    model_ref: str = "zoo:base",
    *,
    arms: dict[str, EmbeddingArgs] | None = None,
    learning_rates: tuple[float, ...] = (1e-3, 3e-3, 1e-2),
    steps: int = 120,
    batch_size: int = 8,
    seq_len: int = 64,
    eval_tokens: int = 2048,
    lm_weight: float = 1.0,
    distill_weight: float = 1.0,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> Report:
    """Train every arm at every learning rate on the zoo's three domains and measure held-out perplexity.

    ``eval_tokens`` per domain for LR selection, the next ``eval_tokens`` per domain for the reported figure.
    """

    t_start = time.perf_counter()
    _, source, tok = load_source_model(model_ref, None)
    cfg = source.config
    max_positions = int(getattr(cfg, "max_position_embeddings", 512))
    arms = arms or default_arms(int(cfg.vocab_size), int(cfg.hidden_size), max_positions=max_positions)
    teacher = table_of(source.get_input_embeddings()).clone()  # taken before any arm touches the body
    corpus = _zoo_corpus(tok, batch_size=batch_size, seq_len=seq_len, eval_tokens=eval_tokens, seed=seed)
    out = _model_facts(model_ref, source)
    out["settings"] = Settings(
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        learning_rates=list(learning_rates),
        lm_weight=lm_weight,
        distill_weight=distill_weight,
        seed=seed,
        eval_tokens_per_domain=eval_tokens,
        threads=torch.get_num_threads(),
    )
    out["original"] = {
        "test": domain_perplexity(source, corpus.test),
        "select": domain_perplexity(source, corpus.select),
    }
    template = TrainSettings(
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lm_weight=lm_weight,
        distill_weight=distill_weight,
        seed=seed,
        log_every=max(1, steps // 4),
    )
    out["arms"] = {
        name: _run_arm(name, kw, source, teacher, corpus, learning_rates, template, log) for name, kw in arms.items()
    }
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    out["verdict"] = verdict(out)
    return out


def verdict(rep: Report) -> str:
    """One honest sentence: does the generative arm beat both fair baselines on the reported split?"""
    arms = rep["arms"]
    if "generative" not in arms:
        return "no generative arm"
    g = arms["generative"]["test"]["mean"]
    parts = []
    for base in ("dense-same-params", "dense-same-depth"):
        if base in arms:
            b = arms[base]["test"]["mean"]
            parts.append(f"{'beats' if g < b else 'does not beat'} {base} ({g:.2f} vs {b:.2f})")
    best = min(arms, key=lambda k: arms[k]["test"]["mean"])
    return f"generative {' and '.join(parts)}; best arm: {best} ({arms[best]['test']['mean']:.2f})"


def render_markdown(rep: Report) -> str:
    """The report as Markdown tables (parameters, then perplexity)."""
    lines = [
        f"Model {rep['model']}: vocab {rep['vocab']}, hidden {rep['hidden']}, body {rep['body_params']:,} params; "
        f"original input table {rep['original_table']:,}; head: {rep['head']['choice']}, {rep['head']['params']:,} "
        f"params (tied to the input table in the original: {rep['head']['tied_in_original']}).",
        "",
        "| arm | table | router | experts | generator | projection | embedding total | vs original table |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, a in rep["arms"].items():
        p = a["params"]
        lines.append(
            f"| {name} | {p['table']:,} | {p['router']:,} | {p['experts']:,} | {p['generator']:,} | "
            f"{p['projection']:,} | {p['total']:,} | {p['total'] / rep['original_table']:.1%} |"
        )
    doms = [k for k in rep["original"]["test"] if k != "mean"]
    lrs = rep["settings"]["learning_rates"]
    lines += [
        "",
        f"Held-out perplexity (test half; {rep['settings']['steps']} steps × {rep['settings']['batch_size']}×"
        f"{rep['settings']['seq_len']} tokens, LR chosen on the select half among {lrs}):",
        "",
        "| arm | step 0 | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr | " + " | ".join(doms) + " | mean |",
        "|---|---|" + "---|" * len(lrs) + "---|" + "---|" * len(doms) + "---|",
    ]
    o = rep["original"]["test"]
    lines.append(
        "| original (untrained) | – | "
        + " | ".join("–" for _ in lrs)
        + " | – | "
        + " | ".join(f"{o[dm]:.2f}" for dm in doms)
        + f" | {o['mean']:.2f} |"
    )
    for name, a in rep["arms"].items():
        t = a["test"]
        lines.append(
            f"| {name} | {a['step0']['mean']:.2f} | "
            + " | ".join(f"{a['runs'][str(lr)]['test']['mean']:.2f}" for lr in lrs)
            + f" | {a['best_lr']:g} | "
            + " | ".join(f"{t[dm]:.2f}" for dm in doms)
            + f" | {t['mean']:.2f} |"
        )
    lines += [
        "",
        f"Verdict: {rep['verdict']}.",
        f"Wall time {rep['seconds']:.0f} s on {rep['settings']['threads']} thread(s).",
    ]
    return "\n".join(lines)
