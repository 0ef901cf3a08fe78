"""``moetool comigs train | bake | adapters``: thin Typer commands over :mod:`moetool.methods.comigs`.

``moetool merge recipe.yaml -o OUT`` (the assembler) writes the untrained per-user models; these commands train them
(in one process, or on Flower), bake a trained user model into a Mixtral checkpoint, or write its experts as PEFT
adapters (→ GGUF LoRA adapters with ``moetool export``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from moetool.commands import friendly as _friendly

comigs_app = typer.Typer(no_args_is_help=True, help="CoMiGS: federated generalist + specialist LoRA experts.")


def _load(model: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from moetool.errors import MoetoolError
    from moetool.methods.comigs.model import ComigsForCausalLM, register

    register()
    if not (model / "config.json").is_file():
        raise MoetoolError(f"{model}: no config.json (expected a user model written by `moetool comigs train`)")
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    if not isinstance(m, ComigsForCausalLM):
        raise MoetoolError(f"{model}: model_type is {m.config.model_type!r}, not moetool_comigs")
    return m.eval()


@comigs_app.command("train")
@_friendly
def train_cmd(
    recipe: Annotated[Path, typer.Argument(help="comigs recipe.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory: one model per user + comigs-report.json.")],
    variant: Annotated[str, typer.Option(help="comigs, or a baseline: 2S, 2G, local, fedavg, tr.")] = "comigs",
    engine: Annotated[
        str, typer.Option(help="inprocess, or flower (simulation engine; needs .venv-flwr).")
    ] = "inprocess",
    rounds: Annotated[int | None, typer.Option(help="Override training.rounds.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Train every user's model: bi-level expert/router steps, generalists averaged each round."""
    from rich.console import Console

    from moetool.errors import MoetoolError
    from moetool.io.atomic import atomic_dir, check_output
    from moetool.methods.comigs.federated import VARIANTS
    from moetool.recipe import load_recipe
    from moetool.recipe.comigs import ComigsRecipe

    console = Console(stderr=True)
    r = load_recipe(recipe)
    if not isinstance(r, ComigsRecipe):
        raise MoetoolError(f"{recipe}: method is {getattr(r, 'method', None)!r}, not comigs")
    if variant not in VARIANTS:
        raise MoetoolError(f"--variant: {variant!r} is not one of {', '.join(VARIANTS)}")
    if rounds is not None:
        r = r.model_copy(update={"training": r.training.model_copy(update={"rounds": rounds})})
    if engine == "flower":
        try:
            from moetool.methods.comigs.flower import simulate
        except ImportError:
            raise MoetoolError(
                "--engine flower: flwr is not installed in this environment; run `bash scripts/setup_comigs.sh` and "
                "use .venv-flwr/bin/moetool (Flower pins protobuf/typer/rich below the main environment's)"
            ) from None
        check_output(output, force=force)
        with atomic_dir(output, force=force) as tmp:
            report = simulate(recipe, tmp, variant=variant, rounds=rounds)
    elif engine == "inprocess":
        from moetool.methods.comigs.pipeline import train

        report = train(r, recipe.parent, output, variant=variant, force=force, log=console.print)
    else:
        raise MoetoolError(f"--engine: {engine!r} is not inprocess or flower")
    for name, u in report["users"].items():
        console.print(f"{name}: test perplexity {u['test_ppl']:.2f}")
    sys.stdout.write(json.dumps({k: report[k] for k in ("variant", "engine", "users")}, indent=2) + "\n")


@comigs_app.command("bake")
@_friendly
def bake_cmd(
    model: Annotated[Path, typer.Argument(help="A user's model directory (from `moetool comigs train`).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Mixtral checkpoint directory.")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Merge every expert's LoRA into its own MLP: a standard Mixtral checkpoint (parity ≤ 1e-5 checked)."""
    import torch
    from transformers import AutoTokenizer

    from moetool.methods.comigs.bake import bake

    m = _load(model)
    tok = AutoTokenizer.from_pretrained(str(model))
    text = "The quick brown fox jumps over the lazy dog. def main(): return 0. Permission is hereby granted."
    ids = torch.tensor([tok(text, add_special_tokens=True)["input_ids"][:64]])
    report = bake(m, output, ids=ids, tokenizer_dir=model, force=force)
    typer.echo(
        f"wrote {output} (Mixtral, {len(report['experts'])} experts, top-{report['top_k']}); "
        f"parity max |Δlogit| {report['parity_max_abs_logit_diff']:.2e} (float64), "
        f"{report['parity_max_abs_logit_diff_float32']:.2e} (float32)"
    )


@comigs_app.command("adapters")
@_friendly
def adapters_cmd(
    model: Annotated[Path, typer.Argument(help="A user's model directory.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory: one PEFT adapter per expert.")],
    base_model: Annotated[str, typer.Option(help="base_model_name_or_path written into each adapter.")] = "",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Each expert (its MLP LoRA + the shared attention LoRA) as a PEFT adapter over the dense base."""
    from moetool.methods.comigs.bake import save_adapters

    m = _load(model)
    dirs = save_adapters(m, output, base_model=base_model, force=force)
    typer.echo(f"wrote {len(dirs)} adapters to {output}: {', '.join(d.name for d in dirs)}")
