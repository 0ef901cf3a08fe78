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
) -> None:
    """Train as the recipe says: mofe tunes routers (and what else the freeze spec allows) with experts frozen."""
    from moetool import api

    res = api.train(recipe, output, model=model, force=force, resume=not no_resume, preset=preset, console=console)
    if not getattr(res.detail, "main_process", True):
        return  # another process of a multi-process launch: the main one reports
    for label, value in res.figures.items():
        figure(label, value)
    out.print(f"[green]wrote[/] {res.output}")


def register(app: typer.Typer) -> None:
    app.command()(train)
