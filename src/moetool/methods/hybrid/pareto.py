"""The Pareto sweep: one router per value of λ2 (or T_u, or the cost weight), judged on held-out requests against
both experts alone and the oracle router, with expected (profile) and measured latency.

Measured latency (sequence routing): on a fixed subset of held-out requests, each expert alone is timed per request
(fastest of ``repeats``), then the routed system is timed live per request (features: embedding lookup + mean;
router; the chosen expert) in the runtime the profile was measured in (llama.cpp for GGUF profiles). The check is
``measured routed ≥ Σ_k share_k · latency_k``, where latency_k is expert k's measured latency on the requests routed
to it, timed in rounds interleaved with the routed runs (paired: both see the same machine state). A router can add
overhead, never remove work; the paper's 0.077 s routed vs 0.078 s for its fast expert alone breaks exactly this.
Timings on a shared machine jitter, so the check allows ``tolerance`` (default 3 %) and the figures are reported
either way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from rich.console import Console

from moetool.io.atomic import atomic_dir
from moetool.methods.hybrid.pipeline import Prepared
from moetool.methods.hybrid.profile import clock, timing_llama, warm_llama
from moetool.methods.hybrid.records import (
    ChoiceFigures,
    LatencyCheck,
    SweepParameter,
    SweepResult,
    SweepRow,
    SweepTiming,
    sweep_parameter,
)
from moetool.methods.hybrid.router import HybridRouter, sequence_features
from moetool.methods.hybrid.training import (
    TrainResult,
    evaluate_choice,
    oracle_choice,
    route,
    soft_nll,
    train_router,
)
from moetool.recipe.hybrid import HybridLossSpec

if TYPE_CHECKING:
    from llama_cpp import Llama

_CLOCK = ["cpu"]


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` runs (seconds) on the profile's clock (profile.clock: CPU time by default)."""
    now = clock(_CLOCK[0])
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        times.append(now() - t0)
    result: float = min(times)
    return result


class Runners:
    """Each expert's forward pass in the runtime its latency profile was measured in: llama.cpp for a profile of
    GGUF files (``experts.<name>.file``), transformers otherwise."""

    def __init__(self, p: Prepared) -> None:
        self.llms: list[Llama] = []
        self.runtime = "transformers"
        files = [f for n in p.names if (f := p.profile["experts"][n].get("file"))]
        if len(files) == len(p.names):
            from moetool.export.gguf.verify import quiet_stderr

            self.quiet = quiet_stderr
            n_ctx = p.recipe.router.max_length
            threads = int(p.profile.get("threads", 1))
            self.llms = [timing_llama(f, n_ctx, threads) for f in files]
            for llm in self.llms:
                warm_llama(llm, len(p.experts[0].tokenizer), n_ctx)
            self.runtime = "llama.cpp"
        self.models = [e.model for e in p.experts]

    def __call__(self, k: int, ids: torch.Tensor) -> None:
        """Run expert ``k`` on ``ids`` ``[1, L]`` (fresh state)."""
        if self.llms:
            self.llms[k].reset()
            with self.quiet():
                self.llms[k].eval(ids[0].tolist())
        else:
            self.models[k](input_ids=ids)

    def close(self) -> None:
        for llm in self.llms:
            with self.quiet():
                llm.close()


def time_experts(p: Prepared, run: Runners, idx: torch.Tensor, repeats: int) -> torch.Tensor:
    """``[n, K]`` seconds: each expert alone on each timed request (median of ``repeats`` after a warm-up)."""
    req = p.valid_requests
    out = torch.zeros(len(idx), len(p.experts))
    with torch.inference_mode():
        for j, i in enumerate(idx.tolist()):
            ids = req.ids[i : i + 1, : int(req.lengths[i])]
            for k in range(len(p.experts)):
                run(k, ids)  # warm
                out[j, k] = _time(partial(run, k, ids), repeats)
    return out


def time_routed(
    p: Prepared, router: HybridRouter, run: Runners, idx: torch.Tensor, repeats: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Paired timing per request: the routed system live (features + router + chosen expert) and the chosen expert
    alone, interleaved in ``repeats`` rounds (fastest of each kept), so both see the same machine state.

    Returns routed seconds ``[n]``, chosen-expert-alone seconds ``[n]`` and the choices ``[n]``.
    """
    req = p.valid_requests
    emb = p.encoder.model.get_input_embeddings() if p.encoder is not None else None
    n = len(idx)
    routed_s, alone_s = torch.full((n,), float("inf")), torch.full((n,), float("inf"))
    choices = torch.zeros(n, dtype=torch.long)

    def routed(ids: torch.Tensor, dom: torch.Tensor) -> int:
        pooled = emb(ids).mean(dim=1) if emb is not None else None
        feats = sequence_features(p.layout, torch.tensor([ids.shape[1]]), dom, pooled)
        k = int(router.choose(feats)[0])
        run(k, ids)
        return k

    with torch.inference_mode():
        for j, i in enumerate(idx.tolist()):
            ids = req.ids[i : i + 1, : int(req.lengths[i])]
            dom = req.domains[i : i + 1]
            k = choices[j] = routed(ids, dom)  # also the warm-up
            for _ in range(repeats):
                routed_s[j] = min(float(routed_s[j]), _time(partial(routed, ids, dom), 1))
                alone_s[j] = min(float(alone_s[j]), _time(partial(run, k, ids), 1))
    return routed_s, alone_s, choices


def train_recipe_router(p: Prepared, loss: HybridLossSpec) -> TrainResult:
    """The router trained as the recipe's ``router`` and ``train`` sections say, under ``loss`` (a recipe loss
    section, e.g. the recipe's own with one weight swept)."""
    r = p.recipe
    return train_router(
        p.train,
        costly=p.costly,
        loss=loss,
        hidden=r.router.hidden_size,
        utility_head=r.router.utility_head,
        epochs=r.train.epochs,
        batch_size=r.train.batch_size,
        lr=r.train.learning_rate,
        seed=r.train.seed,
    )


def baselines_of(p: Prepared) -> dict[str, ChoiceFigures]:
    """The held-out figures every router is judged against: each expert alone, and the oracle router."""
    valid = p.valid
    shape = tuple(valid.features.shape[:-1])
    out = {
        f"{n} alone": evaluate_choice(valid, torch.full(shape, k, dtype=torch.long), p.costly, alone=True)
        for k, n in enumerate(p.names)
    }
    out["oracle"] = evaluate_choice(valid, oracle_choice(valid, p.costly), p.costly)
    return out


def latency_check(
    p: Prepared,
    router: HybridRouter,
    run: Runners,
    idx: torch.Tensor,
    alone: torch.Tensor,
    *,
    repeats: int,
    tolerance: float,
) -> LatencyCheck:
    """The routed system timed live on the requests ``idx`` against the sum of its parts (module docstring);
    ``alone`` [n, K]: each expert's seconds on those requests from :func:`time_experts`."""
    secs, paired, ch = time_routed(p, router, run, idx, repeats)
    parts = float(paired.mean())  # Σ_k share_k·latency_k, latency_k on the requests routed to k
    unconditional = sum(float((ch == k).float().mean()) * float(alone[:, k].mean()) for k in range(len(p.names)))
    measured = float(secs.mean())
    return LatencyCheck(
        measured_latency_ms=1000 * measured,
        sum_share_latency_ms=1000 * parts,
        sum_share_mean_latency_ms=1000 * unconditional,
        router_overhead_ms=1000 * (measured - parts),
        latency_check=measured >= parts * (1 - tolerance),
    )


def _sweep_row(p: Prepared, parameter: SweepParameter, value: float) -> tuple[SweepRow, HybridRouter]:
    """Train the router at ``parameter = value`` and score its routing of the held-out requests."""
    r = p.recipe
    router = train_recipe_router(p, r.loss.model_copy(update={parameter: value})).router
    choice = route(
        router, p.valid, costly=p.costly, decision=r.router.decision, utility_threshold=r.router.utility_threshold
    )
    row = SweepRow(**evaluate_choice(p.valid, choice, p.costly))
    row[parameter] = value
    row["soft_nll"] = soft_nll(router, p.valid)
    return row, router


def sweep(
    p: Prepared,
    *,
    parameter: str | None = None,
    values: list[float] | None = None,
    timed_requests: int = 48,
    repeats: int = 5,
    tolerance: float = 0.03,
    threads: int = 1,
    console: Console | None = None,
) -> SweepResult:
    """Train one router per value and evaluate everything on the held-out requests."""
    r = p.recipe
    swept = sweep_parameter(parameter or r.sweep.parameter)
    values = values if values is not None else r.sweep.values
    baselines = baselines_of(p)
    measure = timed_requests > 0 and r.router.granularity == "sequence"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    run: Runners | None = None
    _CLOCK[0] = p.profile.get("clock", "wall")
    try:
        idx = torch.randperm(len(p.valid_requests), generator=torch.Generator().manual_seed(1))[:timed_requests]
        run = Runners(p) if measure else None
        alone = time_experts(p, run, idx, repeats) if run is not None else None
        if alone is not None:
            for k, n in enumerate(p.names):
                baselines[f"{n} alone"]["measured_latency_ms"] = 1000 * float(alone[:, k].mean())
        rows = []
        for v in values:
            row, router = _sweep_row(p, swept, v)
            if alone is not None and run is not None:
                row.update(latency_check(p, router, run, idx, alone, repeats=repeats, tolerance=tolerance))
            rows.append(row)
            if console is not None:
                console.print(
                    f"  {swept}={v:g}: perplexity {row['perplexity']:.3f}, costly share "
                    f"{row['costly_share']:.3f}, expected {row['expected_latency_ms']:.2f} ms"
                )
    finally:
        torch.set_num_threads(before)
        if run is not None:
            run.close()
    timing = SweepTiming(
        repeats=repeats,
        threads=threads,
        clock=_CLOCK[0],
        tolerance=tolerance,
        runtime=run.runtime if measure and run is not None else None,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        note="llama.cpp timed in a process that also runs torch is only reliable with "
        "OMP_WAIT_POLICY=PASSIVE set before torch loads (bench/hybrid_pareto.py sets it)",
    )
    return _sweep_result(p, swept, baselines, rows, timed_requests=len(idx) if measure else 0, timing=timing)


def _sweep_result(
    p: Prepared,
    parameter: SweepParameter,
    baselines: dict[str, ChoiceFigures],
    rows: list[SweepRow],
    *,
    timed_requests: int,
    timing: SweepTiming,
) -> SweepResult:
    """pareto.json: the rows and baselines with what they were measured on and how (``timing``: repeats, threads,
    clock and tolerance of the measurement, and the runtime timed)."""
    r = p.recipe
    return SweepResult(
        parameter=parameter,
        costly=p.names[p.costly],
        experts=p.names,
        granularity=r.router.granularity,
        device=p.profile["device"],
        held_out_requests=int(p.valid.features.shape[0]),
        timed_requests=timed_requests,
        timing=timing,
        loss=r.loss.model_dump(mode="json"),
        baselines=baselines,
        rows=rows,
        oracle_definition="per held-out request, the expert with the lower mean NLL per token on that request "
        "(ties to the cheap expert); ignores latency",
    )


def table(result: SweepResult) -> str:
    """Markdown table of the sweep and the baselines."""
    par = result["parameter"]
    measured = result["timed_requests"] > 0
    head = ["router", "perplexity", "NLL", "costly share", "expected ms"]
    if measured:
        head += ["measured ms", "Σ share·lat ms", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def line(name: str, row: ChoiceFigures) -> str:
        cells = [
            name,
            f"{row['perplexity']:.3f}",
            f"{row['nll']:.4f}",
            f"{row['costly_share']:.3f}",
            f"{row['expected_latency_ms']:.2f}",
        ]
        if measured:
            cells += [
                f"{row['measured_latency_ms']:.2f}" if "measured_latency_ms" in row else "",
                f"{row['sum_share_latency_ms']:.2f}" if "sum_share_latency_ms" in row else "",
                ("ok" if row["latency_check"] else "FAIL") if "latency_check" in row else "",
            ]
        return "| " + " | ".join(cells) + " |"

    for name, row in result["baselines"].items():
        lines.append(line(name, row))
    for row in result["rows"]:
        lines.append(line(f"{par} = {row[par]:g}", row))
    return "\n".join(lines)


def plot(result: SweepResult, path: Path) -> None:
    """Two panels: held-out perplexity against expected latency, and against the costly-expert share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    par = result["parameter"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    rows = result["rows"]
    panels: tuple[tuple[Literal["expected_latency_ms", "costly_share"], str], ...] = (
        ("expected_latency_ms", "expected latency per request (ms, fitted profile)"),
        ("costly_share", f"share of requests to {result['costly']} (costly)"),
    )
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.plot([r[key] for r in rows], [r["perplexity"] for r in rows], "o-", label=f"router, {par} sweep")
        for r in rows:
            ax.annotate(f"{r[par]:g}", (r[key], r["perplexity"]), fontsize=7, textcoords="offset points", xytext=(4, 4))
        for (name, b), marker in zip(result["baselines"].items(), ("s", "D", "*"), strict=False):
            ax.plot([b[key]], [b["perplexity"]], marker, markersize=9, label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out perplexity (lower is better)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"hybrid Pareto sweep on {result['device']} ({result['held_out_requests']} held-out requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_sweep(result: SweepResult, output: Path, *, force: bool = False) -> Path:
    """``output/``: pareto.json, pareto.md, pareto.png (atomically)."""
    with atomic_dir(Path(output), force=force) as tmp:
        (tmp / "pareto.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        (tmp / "pareto.md").write_text(table(result) + "\n", encoding="utf-8")
        plot(result, tmp / "pareto.png")
    return Path(output)
