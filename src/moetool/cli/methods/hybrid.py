"""``moetool profile`` and ``moetool hybrid pareto|zoo-mamba`` (and ``hybrid export``, an alias of ``moetool export``):
thin Typer commands over the hybrid package.

moetool.cli registers these; anything taken from it is imported when a command runs, not at import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from moetool.cli.console import console, float_list, friendly, int_list, out
from moetool.cli.export import register_alias
from moetool.cli.options import PROFILES, OldDeviceOpt, old_spelling

app = typer.Typer(no_args_is_help=True, help="Heterogeneous experts behind a cost-aware router (method: hybrid).")
register_alias(app, "hybrid models: router.onnx + each expert as --target + dispatcher")


@friendly
def profile_cmd(
    model: Annotated[Path, typer.Argument(help="Hybrid model directory (written by `moetool merge`).")],
    for_: Annotated[
        str | None,
        typer.Option(
            "--for",
            help=f"The deployment device the profile describes (a {PROFILES} name, or any label; default: "
            "this-machine).",
        ),
    ] = None,
    from_file: Annotated[Path | None, typer.Option("--from", help="A profile JSON measured on the device.")] = None,
    gguf: Annotated[
        Path | None,
        typer.Option(help="A `moetool export` folder of the hybrid model: time its GGUF experts in llama.cpp."),
    ] = None,
    lengths: Annotated[str, typer.Option(help="Comma-separated request lengths (tokens).")] = "16,32,64,128,256",
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per length; the fastest counts.")] = 10,
    threads: Annotated[int, typer.Option(min=1, help="torch / llama.cpp threads while measuring.")] = 1,
    clock: Annotated[str, typer.Option(help="cpu (compute thread's CPU time) or wall.")] = "cpu",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of MODEL.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing profile.")] = False,
    old_device: OldDeviceOpt = None,
) -> None:
    """Measure each expert's latency over request lengths (or read a device's), fit a·L + b·L² + c0, store it."""
    from moetool.errors import MoetoolError
    from moetool.io.checks import check_report_path
    from moetool.methods.hybrid.assemble import read_model
    from moetool.methods.hybrid.profile import PROFILE_FILE, latency_at, measure_profile, read_profile

    named = old_spelling("profile", "--device", old_device, for_)
    device = named or "this-machine"
    ls = int_list("--lengths", lengths, minimum=1, distinct=2)  # the fit needs two lengths, each of 1 token or more
    meta, _ = read_model(model)
    names = [e["name"] for e in meta["experts"]]
    target = output or model / PROFILE_FILE
    # the profile belongs in the model folder; it must not replace the --from file or a --gguf export it reads
    check_report_path(target, [p for p in (from_file, gguf) if p is not None], option="--output")
    if target.exists() and not force:
        raise MoetoolError(f"{target} exists; pass --force to replace it")
    vocab = int(meta["tokenizer"]["vocab_size"])
    if from_file is not None:
        prof = read_profile(from_file, names)
        prof["device"] = named or prof["device"]
    elif gguf is not None:
        from moetool.methods.hybrid.export import load_export
        from moetool.methods.hybrid.profile import measure_gguf_profile

        man = load_export(gguf)
        files = {e["name"]: gguf / e["dir"] / e["file"] for e in man["experts"] if e.get("file")}
        if set(files) != set(names):
            raise MoetoolError(f"{gguf}: experts {sorted(set(names) - set(files))} have no exported file")
        with console.status(f"timing {', '.join(names)} in llama.cpp at {ls}"):
            prof = measure_gguf_profile(
                files, device=device, lengths=ls, repeats=repeats, threads=threads, vocab=vocab, clock_name=clock
            )
    else:
        from transformers import AutoModelForCausalLM

        models = {e["name"]: AutoModelForCausalLM.from_pretrained(e["path"]).eval() for e in meta["experts"]}
        with console.status(f"timing {', '.join(names)} at {ls}"):
            prof = measure_profile(
                models, device=device, lengths=ls, repeats=repeats, threads=threads, vocab=vocab, clock_name=clock
            )
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(prof, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, target)
    _print_profile(prof)
    slow = max(names, key=lambda n: latency_at(prof["experts"][n]["fit"], meta["router"]["layout"]["max_length"]))
    out.print(
        f"[green]wrote[/] {target}; costly at max_length: {slow} (trained with: {meta['costly']}; "
        "retrain with profile.file to use a new profile in the loss)"
    )


def _print_profile(prof: dict[str, Any]) -> None:
    """Each expert's measured latency per length and its fit."""
    from rich.table import Table

    t = Table(title=f"latency on {prof['device']} (ms)")
    t.add_column("expert")
    some = next(iter(prof["experts"].values()))["lengths"]
    for n in some:
        t.add_column(f"L={n}", justify="right")
    t.add_column("fit: a·L + b·L² + c0", justify="left")
    for name, e in prof["experts"].items():
        f = e["fit"]
        t.add_row(
            name,
            *[f"{1000 * s:.2f}" for s in e["seconds"]],
            f"a={1000 * f['a']:.4f} b={1000 * f['b']:.2e} c0={1000 * f['c0']:.2f} ms, "
            f"max rel err {100 * f['max_rel_error']:.0f}%",
        )
    out.print(t)


@app.command("pareto")
@friendly
def pareto_cmd(
    recipe: Annotated[Path, typer.Argument(help="A method: hybrid recipe.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for pareto.json/.md/.png.")],
    parameter: Annotated[str | None, typer.Option(help="lambda_penalty, threshold or cost_weight.")] = None,
    values: Annotated[str | None, typer.Option(help="Comma-separated values (default: the recipe's sweep).")] = None,
    timed_requests: Annotated[int, typer.Option(min=0, help="Held-out requests timed live per point (0: none).")] = 48,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Sweep λ2 (or T_u, or the cost weight): held-out quality vs expected and measured latency and costly share."""
    import sys

    if "torch" not in sys.modules:  # llama.cpp timing next to torch needs passive OpenMP threads (see pareto.py)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from moetool.errors import MoetoolError
    from moetool.io.atomic import check_output
    from moetool.methods.hybrid.pareto import sweep, table, write_sweep
    from moetool.methods.hybrid.pipeline import prepare
    from moetool.recipe import load_recipe
    from moetool.recipe.hybrid import HybridRecipe, sweep_value_problem

    r = load_recipe(recipe)
    if not isinstance(r, HybridRecipe):
        raise MoetoolError(f"{recipe}: method is {r.method!r}, not hybrid")
    if parameter not in (None, "lambda_penalty", "threshold", "cost_weight"):
        raise MoetoolError(f"--parameter: {parameter!r} is not lambda_penalty, threshold or cost_weight")
    vals = float_list("--values", values) if values else None
    for v in vals or []:  # checked as the recipe's own sweep.values are
        problem = sweep_value_problem(r.loss, parameter or r.sweep.parameter, v)
        if problem:
            raise MoetoolError(f"--values {v:g} as loss.{parameter or r.sweep.parameter}: {problem}")
    check_output(output, force=force)
    p = prepare(r, recipe.parent, console)
    result = sweep(p, parameter=parameter, values=vals, timed_requests=timed_requests, console=console)
    write_sweep(result, output, force=force)
    out.print(table(result))
    out.print(f"[green]wrote[/] {output}/pareto.json, pareto.md, pareto.png")


@app.command("zoo-mamba")
@friendly
def zoo_mamba_cmd(
    profile: Annotated[str, typer.Option(help="Zoo profile whose tokenizer and text it uses: default or smollm2.")] = (
        "default"
    ),
    force: Annotated[bool, typer.Option("--force", help="Retrain even if cached.")] = False,
) -> None:
    """Train a zoo's Mamba expert (zoo:mamba, zoo:smollm2-mamba) with that zoo's tokenizer and corpora (one thread:
    ~5-10 min for the default zoo, ~9 min for smollm2's 49k-token vocabulary)."""
    from moetool.methods.hybrid.zoo_mamba import build_zoo_mamba

    out.print(f"[green]zoo mamba ready[/] at {build_zoo_mamba(profile, force=force, console=console)}")
