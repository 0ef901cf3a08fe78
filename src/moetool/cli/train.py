"""``moetool train``: the recipe method's training (mofe: router tuning of the merged MoE, resumable; runs under
``accelerate launch``, see examples/accelerate/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetool.cli.console import console, figure, friendly, out


@friendly
def train(
    recipe: Annotated[Path, typer.Argument(help="Recipe with its training section (mofe: freeze: and train:).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory.")],
    model: Annotated[Path | None, typer.Option("--model", help="mofe: the merged MoE to tune.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="Ignore a checkpoint of an interrupted run.")] = False,
    preset: Annotated[str | None, typer.Option(help="mofe: override freeze.preset (mofe, router_only, full).")] = None,
    dtype: Annotated[
        str,
        typer.Option(
            help="mofe: auto (the model's own dtype), float32, bfloat16 or float16. 16-bit keeps the trainable "
            "weights in float32; the tuned model is written in this dtype."
        ),
    ] = "auto",
    device: Annotated[str, typer.Option(help="mofe: auto (a GPU when there is one), cpu, cuda or cuda:N.")] = "auto",
) -> None:
    """Train as the recipe says: mofe tunes routers (and what else the freeze spec allows) with experts frozen."""
    from moetool import api

    extra = {"dtype": dtype, "device": device} if (dtype, device) != ("auto", "auto") else {}
    res = api.train(
        recipe, output, model=model, force=force, resume=not no_resume, preset=preset, console=console, **extra
    )
    if not getattr(res.detail, "main_process", True):
        return  # another process of a multi-process launch: the main one reports
    for label, value in res.figures.items():
        figure(label, value)
    out.print(f"[green]wrote[/] {res.output}")


def register(app: typer.Typer) -> None:
    app.command()(train)
