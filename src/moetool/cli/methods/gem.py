"""``moetool gem …``: evaluate and inspect the routing of a GEM model (``moetool merge`` builds it, ``moetool export``
exports it; ``moetool gem export`` is an alias of it).

The registry (:data:`moetool.registry.METHODS`) attaches ``app`` as ``moetool gem``; heavy imports stay in commands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from moetool.cli.console import console, friendly, out
from moetool.cli.export import register_alias
from moetool.cli.options import JsonOpt

app = typer.Typer(no_args_is_help=True, help="GEM models: evaluation (GG/CDTR/DSI), export, routing logs.")
register_alias(app, "GEM models and bundles")


def _print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    from moetool.eval.perplexity import render_matrix

    out.print(render_matrix(report["perplexity"], "held-out perplexity (lower is better)"))
    t = Table(title="GEM metrics (Perf = 1/perplexity; general models: mean over domains)")
    for col in ("model", "GG", "DSI"):
        t.add_column(col)
    for m, v in report["gem"].items():
        t.add_row(m, f"{v['gg']:.3f}", f"{v['dsi']:.3f}")
    out.print(t)
    t = Table(title="routing share per domain text (general / pathways)")
    t.add_column("model")
    t.add_column("text")
    t.add_column("shares")
    for m, per in report["routing"].items():
        for d, sh in per.items():
            t.add_row(m, d, "  ".join(f"{k} {v:.2f}" for k, v in sh.items()))
    out.print(t)
    t = Table(title="experiment: GEM (fallback) vs the plain domain expert")
    for col in (
        "domain",
        "GG expert",
        "GG gem",
        "GG gem τ=0",
        "ppl in-domain expert",
        "gem",
        "gem τ=0",
        "ppl out-of-domain expert",
        "gem",
    ):
        t.add_column(col)
    for d, r in report["experiment"].items():
        t.add_row(
            d,
            f"{r['gg_expert']:.3f}",
            f"{r['gg_gem']:.3f}",
            f"{r['gg_gem_no_fallback']:.3f}",
            f"{r['ppl_in_domain_expert']:.2f}",
            f"{r['ppl_in_domain_gem']:.2f}",
            f"{r['ppl_in_domain_no_fallback']:.2f}",
            f"{r['ppl_out_of_domain_expert']:.2f}",
            f"{r['ppl_out_of_domain_gem']:.2f}",
        )
    out.print(t)


@app.command("eval")
@friendly
def eval_cmd(
    model: Annotated[Path, typer.Argument(help="A GEM model or bundle written by `moetool merge`.")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the report as JSON to this file.")
    ] = None,
    as_json: JsonOpt = False,
    seq_len: Annotated[int, typer.Option(min=2, help="Window length in tokens.")] = 256,
    max_tokens: Annotated[int, typer.Option(min=1, help="Held-out tokens per domain.")] = 8192,
) -> None:
    """GG, CDTR, DSI of the GEM model (at its tau, tau 0 and tau 1), its general model and every expert, on each
    domain's held-out text from the recipe it was built from."""
    import torch

    from moetool import api
    from moetool.io.sources import resolve_source
    from moetool.methods.gem.evaluate import gem_report
    from moetool.methods.gem.heldout import built_recipe, domain_held_out

    torch.set_num_threads(1)
    r = built_recipe(model)
    experts = {d.name: resolve_source(d.source).path for d in r.domains}
    general = resolve_source(r.general).path
    api.check_report_outputs(output, None, [model, general, *experts.values()])  # before minutes of evaluation
    texts = domain_held_out(model)
    report = gem_report(model, general, experts, texts, seq_len=seq_len, max_tokens=max_tokens)
    if as_json:  # stdout carries the JSON only
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        _print_report(report)
    for path in api.write_report(report, output, None):
        (console if as_json else out).print(f"wrote {path}")


@app.command("route")
@friendly
def route_cmd(
    model: Annotated[Path, typer.Argument(help="A token-level GEM model.")],
    text: Annotated[str, typer.Option(help="Text to route.")],
    tau: Annotated[
        float | None, typer.Option(min=0.0, max=1.0, help="Threshold in [0, 1] (default: the model's).")
    ] = None,
    log: Annotated[Path | None, typer.Option(help="Write every decision as JSON lines.")] = None,
) -> None:
    """Per-token routing decisions: pathway, max P(d|x) and every P."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moetool.methods.gem.model  # noqa: F401  (registers its model class)
    from moetool.io.atomic import atomic_write_text
    from moetool.io.checks import check_report_path
    from moetool.methods.gem.router import log_decisions

    if log is not None:
        check_report_path(log, [model], option="--log")
    m = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    rows = log_decisions(m, AutoTokenizer.from_pretrained(str(model)), text, tau)
    if log:
        atomic_write_text(log, "".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        sys.stdout.write(f"{r['pos']:4d} {r['token']!r:>16} → {r['route']:<10} max P {r['max_p']:.3f}\n")
