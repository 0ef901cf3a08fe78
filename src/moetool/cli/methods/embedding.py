"""``moetool embedding report`` (and ``moetool embedding export``, an alias of ``moetool export``): thin Typer commands.

moetool.cli registers these near its end, so anything taken from it is imported when a command runs, not at import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from moetool.cli.console import console, float_list, friendly, out
from moetool.cli.export import register_alias

app = typer.Typer(
    no_args_is_help=True, help="Routed input embeddings (method: embedding): export and the parameter/quality report."
)
register_alias(app, "routed-embedding models")


@app.command("report")
@friendly
def embedding_report_cmd(
    model: Annotated[str, typer.Argument(help="Causal LM directory or zoo:NAME.")] = "zoo:base",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write report.json and report.md here.")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Training steps per arm and learning rate.")] = 120,
    lrs: Annotated[str, typer.Option(help="Comma-separated learning rates swept for every arm.")] = "1e-3,3e-3,1e-2",
    eval_tokens: Annotated[int, typer.Option(min=1, help="Held-out tokens per domain, per split.")] = 2048,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Parameters and held-out perplexity of routed embeddings against fair dense baselines (zoo domains)."""
    from moetool.io.atomic import atomic_dir, check_output
    from moetool.io.checks import check_output_path
    from moetool.io.sources import resolve_source
    from moetool.methods.embedding.report import render_markdown, run_report

    rates = tuple(float_list("--lrs", lrs, positive=True))
    if output is not None:
        check_output_path(output, [resolve_source(model).path])  # --force over the model would delete it
        check_output(output, force=force)
    rep = run_report(model, steps=steps, learning_rates=rates, eval_tokens=eval_tokens, log=console.print)
    md = render_markdown(rep)
    if output is not None:
        with atomic_dir(output, force=force) as tmp:
            (tmp / "report.json").write_text(json.dumps(rep, indent=2))
            (tmp / "report.md").write_text(md + "\n")
    out.print(md)
