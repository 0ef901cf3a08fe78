"""PNG plots of an evaluation report: the perplexity matrix and routing share per layer and domain.

The report is read as the JSON it is written as (:func:`moetool.eval.report.evaluate`'s, or one read back from
``eval.json``): a part it lacks draws nothing, a figure it lacks draws as NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from moetool.io.jsontypes import JsonValue


def _agg() -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display


def _object(value: JsonValue | None) -> dict[str, JsonValue]:
    """``value`` where it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def _list(value: JsonValue | None) -> list[JsonValue]:
    """``value`` where it is a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


def _number(value: JsonValue | None, missing: float = math.nan) -> float:
    return float(value) if isinstance(value, int | float) else missing


def perplexity_heatmap(report: Mapping[str, JsonValue], path: Path) -> Path:
    """Models × domains heatmap of held-out perplexity, each cell annotated, best per domain outlined."""
    _agg()
    import matplotlib.pyplot as plt

    table = _object(report.get("perplexity"))
    models = list(table)
    domains = [str(d) for d in _list(report.get("domains"))]
    vals = [[_number(_object(table[m]).get(d)) for d in domains] for m in models]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(domains), 0.9 + 0.5 * len(models)))
    im = ax.imshow(vals, cmap="viridis_r", aspect="auto")
    ax.set_xticks(range(len(domains)), domains)
    ax.set_yticks(range(len(models)), models)
    for j in range(len(domains)):
        best = min(range(len(models)), key=lambda i: vals[i][j])
        for i in range(len(models)):
            weight = "bold" if i == best else "normal"
            ax.text(j, i, f"{vals[i][j]:.2f}", ha="center", va="center", color="white", fontweight=weight)
    fig.colorbar(im, ax=ax, label="perplexity (lower is better)")
    ax.set_title("held-out perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def routing_share_plot(report: Mapping[str, JsonValue], model: str, path: Path) -> Path:
    """One panel per domain: stacked bars of each expert's share of top-k assignments, per layer."""
    _agg()
    import matplotlib.pyplot as plt

    routing = _object(_object(report.get("routing")).get(model))
    per_domain = _object(routing.get("per_domain"))
    domains = list(per_domain)
    shares = {  # [L][E] per domain
        d: [[_number(x) for x in _list(layer)] for layer in _list(_object(per_domain[d]).get("expert_share"))]
        for d in domains
    }
    n_exp = len(shares[domains[0]][0])
    names = [str(n) for n in _list(routing.get("experts"))] or [f"expert {i}" for i in range(n_exp)]
    fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3.2), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], domains, strict=True):
        share = shares[d]
        bottom = [0.0] * len(share)
        for e in range(n_exp):
            heights = [layer[e] for layer in share]
            ax.bar(range(len(share)), heights, bottom=bottom, label=names[e])
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_title(f"{d} text")
        ax.set_xlabel("layer")
        ax.set_xticks(range(len(share)))
    axes[0][0].set_ylabel("share of routing assignments")
    axes[0][-1].legend(loc="upper right", fontsize="small")
    fig.suptitle(f"routing of {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def task_accuracy_plot(report: Mapping[str, JsonValue], path: Path) -> Path:
    """Grouped bars: each task's accuracy per model, with the standard error as error bars."""
    _agg()
    import matplotlib.pyplot as plt

    scores = {m: _object(row) for m, row in _object(report.get("tasks")).items()}
    models = list(scores)
    named = _list(_object(_object(report.get("settings")).get("tasks")).get("names"))
    tasks = [str(t) for t in named] or sorted({t for r in scores.values() for t in r})
    width = 0.8 / max(len(models), 1)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(tasks), 3.6))
    for i, m in enumerate(models):
        acc = [_number(_object(scores[m].get(t)).get("acc"), 0.0) for t in tasks]
        err = [_number(_object(scores[m].get(t)).get("acc_stderr"), 0.0) for t in tasks]
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(tasks))]
        ax.bar(xs, acc, width, yerr=err, capsize=2, label=Path(m).name or m)
    ax.set_xticks(range(len(tasks)), tasks, rotation=15)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    ax.set_title("task accuracy (lm-evaluation-harness)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(report: Mapping[str, JsonValue], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [perplexity_heatmap(report, out_dir / "perplexity.png")]
    if report.get("tasks"):
        paths.append(task_accuracy_plot(report, out_dir / "tasks.png"))
    for i, model in enumerate(_object(report.get("routing"))):
        paths.append(routing_share_plot(report, model, out_dir / f"routing-{i}-{Path(model).name or 'model'}.png"))
    return paths
