"""``moetool validate | schema | merge | inspect``: recipes and the models they build."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moetool.cli.console import console, friendly, human, out
from moetool.cli.options import JsonOpt
from moetool.errors import MoetoolError


@friendly
def validate(recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")]) -> None:
    """Validate a recipe file, and what it names without reading weights (mofe: every prompt through the base's
    tokenizer, when the base is available)."""
    from moetool import api

    r = api.load(recipe)
    for warning in api.check(r):
        console.print(f"[yellow]warning:[/] {warning}")
    out.print(f"[green]ok[/]: {recipe} (method: {r.method}, name: {r.name})")


def schema() -> None:
    """Print the JSON schema of recipe files."""
    from moetool.recipe.load import dump_schema

    sys.stdout.write(dump_schema() + "\n")


@friendly
def merge(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output directory.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; read no weights, write nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Accept pytorch_model*.bin inputs.")] = False,
    device: Annotated[
        str,
        typer.Option(
            help="mofe: where hidden-state routers run the base: auto (a GPU when there is one), cpu, cuda[:N]."
        ),
    ] = "auto",
) -> None:
    """Build the recipe's model: experts merged into one MoE checkpoint (mofe), or the method's own model."""
    # Before torch loads OpenMP: the merge runs the router forward pass beside the tensor stream and the hashing, so
    # OpenMP's workers share the cores with other threads, and spinning workers (the default) then wait for one
    # another at every parallel region (hidden gates took 7x the wall time on a busy 2-core machine). Passive
    # workers sleep instead; the thread count, so the result's bits, stay the same. An explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from moetool import api
    from moetool.cli.render import print_description, print_plan
    from moetool.methods.base import MethodPlan

    r = api.load(recipe)
    if dry_run:
        plan = api.plan(r, allow_pickle=allow_pickle)
        print_description(plan.render()) if isinstance(plan, MethodPlan) else print_plan(plan)
        return
    if output is None:
        raise MoetoolError("--output is required (or use --dry-run)")
    path = api.assemble(r, output, force=force, allow_pickle=allow_pickle, console=console, device=device)
    out.print(f"[green]wrote[/] {path} (method {r.method})")


@friendly
def inspect(
    model: Annotated[Path, typer.Argument(help="Checkpoint directory.")],
    as_json: JsonOpt = False,
) -> None:
    """Architecture, experts, routers, total and active parameters, size on disk."""
    from moetool.inspect import inspect_model

    info = inspect_model(model)
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        return
    t = Table(title=str(model), show_header=False)
    for k, v in info.items():
        if k in ("total_params", "active_params_per_token") and isinstance(v, int):
            shown = f"{v:,}"
        elif k == "size_on_disk_bytes" and isinstance(v, int):
            shown = human(v)
        else:
            shown = str(v)
        t.add_row(k, shown)
    out.print(t)


def register(app: typer.Typer) -> None:
    app.command()(validate)
    app.command()(schema)
    app.command()(merge)
    app.command()(inspect)
