"""The ``moetool`` command line: thin Typer commands over :mod:`moetool.api` (parse arguments, print results).

Modules: :mod:`.console` (the leaf: consoles, errors, verbosity), :mod:`.render` (tables), one module per command
group; each method's own sub-app comes from the registry (:data:`moetool.registry.METHODS`). Nothing here imports
torch at start-up: ``moetool --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from moetool import registry
from moetool.cli import build, eval, experts, export, merge, package, train, zoo
from moetool.cli.console import set_verbosity, show_deprecations
from moetool.cli.options import CheckedGroup

app = typer.Typer(
    cls=CheckedGroup,  # the checks every command's options share (an empty value refused by name)
    no_args_is_help=True,
    add_completion=False,
    help="Turn domain experts into one Mixture-of-Experts model: merge, tune, evaluate, export, package.",
)


@app.callback()
def _options(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show third-party progress bars, logs and warnings.")
    ] = False,
) -> None:
    set_verbosity(verbose)
    show_deprecations()


for _module in (merge, train, eval, export, experts, zoo, build, package):
    _module.register(app)
for _name, _entry in registry.METHODS.items():
    if _entry.cli is not None:
        app.add_typer(registry.load(_entry.cli), name=_name)
    for _command, _spec in _entry.commands:
        app.command(_command)(registry.load(_spec))


def main() -> None:
    app()


__all__ = ["app", "main"]
