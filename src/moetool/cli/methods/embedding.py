"""``moetool embedding export`` and ``moetool embedding report``: thin Typer commands over this package.

moetool.cli registers these near its end, so anything taken from it is imported when a command runs, not at import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from moetool.cli.console import console, float_list, friendly, out

app = typer.Typer(
    no_args_is_help=True, help="Routed input embeddings (method: embedding): export and the parameter/quality report."
)


@app.command("export")
@friendly
def embedding_export_cmd(
    model: Annotated[
        Path, typer.Argument(help="A routed-embedding model directory (moetool merge, method embedding).")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Artifact directory to write.")],
    target: Annotated[str, typer.Option(help="onnx (gguf is refused: llama.cpp has no such architecture).")] = "onnx",
    eval_text: Annotated[Path | None, typer.Option("--eval-text", help="Held-out text file for parity.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Export a routed-embedding model (router and body as standard ops) and check it in its runtime."""
    from moetool.errors import MoetoolError

    if not (model / "config.json").is_file():  # a local folder: never a Hub lookup for a mistyped path
        raise MoetoolError(f"{model}: not a routed-embedding model directory (no config.json)")
    from moetool.io.checks import check_output_path
    from moetool.io.safe import read_text
    from moetool.methods.embedding.export import export_routed

    check_output_path(output, [model])  # --force over the model (or a folder holding it) would delete it

    text = read_text(eval_text, what="--eval-text") if eval_text is not None else None
    m = export_routed(model, target, output, force=force, eval_text=text)
    p = m["parity"]
    diffs = list(p.get("max_abs_logit_diff", p.get("converted_wrapper_vs_transformers", {})).values())
    if "decode" in p:
        diffs.append(p["decode"]["max_abs_logit_diff"])
    agree = f", top-1 agreement {p['top1_agreement']:.3f}" if "top1_agreement" in p else ""
    where = "" if "max_abs_logit_diff" in p else " (converted wrapper; no runtime here)"
    out.print(f"[green]wrote[/] {output} ({target}, {m['runtime']}): max |Δlogit| {max(diffs):.2e}{where}{agree}")


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
