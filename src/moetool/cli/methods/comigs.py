"""``moetool comigs train | bake | adapters``: thin Typer commands over :mod:`moetool.methods.comigs`.

``moetool merge recipe.yaml -o OUT`` writes the untrained per-user models; these commands train them (in one
process, or on Flower), bake a trained user model into a Mixtral checkpoint (``moetool export`` does that by itself),
or write its experts as PEFT adapters (→ GGUF LoRA adapters with ``moetool export``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from moetool.cli.console import console, figure, friendly, out

app = typer.Typer(no_args_is_help=True, help="CoMiGS: federated generalist + specialist LoRA experts.")


def _flower(recipe: Path, output: Path, *, variant: str, rounds: int | None, force: bool) -> dict[str, Any]:
    from moetool.extras import require
    from moetool.io.atomic import atomic_dir, check_output

    # flower.py imports flwr at module level: check the extra first, so a missing one is one sentence
    require("flwr", "comigs", why="--engine flower")
    from moetool.methods.comigs.flower import simulate

    check_output(output, force=force)
    with atomic_dir(output, force=force) as tmp:
        report: dict[str, Any] = simulate(recipe, tmp, variant=variant, rounds=rounds)
    return report


@app.command("train")
@friendly
def train_cmd(
    recipe: Annotated[Path, typer.Argument(help="comigs recipe.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory: one model per user + comigs-report.json.")],
    variant: Annotated[str, typer.Option(help="comigs, or a baseline: 2S, 2G, local, fedavg, tr.")] = "comigs",
    engine: Annotated[
        str, typer.Option(help="inprocess, or flower (simulation engine; needs .venv-flwr).")
    ] = "inprocess",
    rounds: Annotated[int | None, typer.Option(min=1, help="Override training.rounds.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Train every user's model: bi-level expert/router steps, generalists averaged each round."""
    from moetool import api
    from moetool.errors import MoetoolError

    r = api.load(recipe)
    if r.method != "comigs":
        raise MoetoolError(f"{recipe}: method is {r.method!r}, not comigs")
    if engine == "flower":
        report = _flower(recipe, output, variant=variant, rounds=rounds, force=force)
        for name, u in report["users"].items():
            figure(f"{name} test perplexity", f"{u['test_ppl']:.2f}")
    elif engine == "inprocess":
        res = api.train(r, output, force=force, console=console, variant=variant, rounds=rounds)
        for label, value in res.figures.items():
            figure(label, value)
    else:
        raise MoetoolError(f"--engine: {engine!r} is not inprocess or flower")
    out.print(f"[green]wrote[/] {output} (report: {output / 'comigs-report.json'})")


@app.command("bake")
@friendly
def bake_cmd(
    model: Annotated[Path, typer.Argument(help="A user's model directory (from `moetool comigs train`).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Mixtral checkpoint directory.")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Merge every expert's LoRA into its own MLP: a standard Mixtral checkpoint (parity ≤ 1e-5 checked)."""
    from moetool.io.checks import check_output_path
    from moetool.methods.comigs.bake import bake_user

    check_output_path(output, [model])  # --force over the user's model (or a folder holding it) would delete it
    report = bake_user(model, output, force=force)
    typer.echo(
        f"wrote {output} (Mixtral, {len(report['experts'])} experts, top-{report['top_k']}); "
        f"parity max |Δlogit| {report['parity_max_abs_logit_diff']:.2e} (float64), "
        f"{report['parity_max_abs_logit_diff_float32']:.2e} (float32)"
    )


@app.command("adapters")
@friendly
def adapters_cmd(
    model: Annotated[Path, typer.Argument(help="A user's model directory.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory: one PEFT adapter per expert.")],
    base_model: Annotated[str, typer.Option(help="base_model_name_or_path written into each adapter.")] = "",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Each expert (its MLP LoRA + the shared attention LoRA) as a PEFT adapter over the dense base."""
    from moetool.io.checks import check_output_path
    from moetool.methods.comigs.bake import load_user, save_adapters

    check_output_path(output, [model])
    dirs = save_adapters(load_user(model), output, base_model=base_model, force=force)
    typer.echo(f"wrote {len(dirs)} adapters to {output}: {', '.join(d.name for d in dirs)}")
