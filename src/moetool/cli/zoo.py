"""``moetool zoo build``: the self-trained demo zoo of domain experts."""

from __future__ import annotations

from typing import Annotated

import typer

from moetool.cli.console import console, friendly, out

zoo_app = typer.Typer(no_args_is_help=True, help="The self-trained demo zoo of domain experts.")


@zoo_app.command("build")
@friendly
def zoo_build(
    profile: Annotated[str, typer.Option(help="Zoo profile: default or tiny.")] = "default",
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if cached.")] = False,
) -> None:
    """Train the base LM and one expert per domain on text already on this machine (cached)."""
    from moetool.zoo import build_zoo

    res = build_zoo(profile, force=force, console=console)
    out.print(f"[green]zoo ready[/] at {res.root}")


def register(app: typer.Typer) -> None:
    app.add_typer(zoo_app, name="zoo")
