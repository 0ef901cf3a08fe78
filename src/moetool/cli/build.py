"""``moetool build`` and ``moetool demo``: the whole pipeline (:func:`moetool.api.build`), printed stage by stage."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Any

import typer

from moetool.cli.console import console, figure, friendly, out


def _printer(name: str, value: Any) -> None:
    """Print each stage's result as it lands (``api.build``'s ``on_stage``)."""
    from moetool.cli.render import print_export_plan, print_manifest, print_report

    if name == "merged":
        out.print(f"[green]wrote[/] {value}")
    elif name == "trained":
        preset, outcome = value
        for label, text in outcome.figures.items():
            figure(f"{preset or 'tuning'}: {label}", text)
    elif name == "evaluated":
        print_report(value)
    elif name == "export_plan":
        dir_name, exporter, plan = value
        label = getattr(getattr(plan, "quant", None), "label", "")  # a method's own exporter plans no quantization
        print_export_plan(exporter, plan, f"{exporter.name} plan '{label}' for {plan.name} ({dir_name})")
    elif name == "exported":
        print_manifest(*value)
    elif name == "answered":
        out.print(f"[green]answered[/] {len(value)} questions (answers.json)")
    elif name == "packaged":
        out.print(f"[green]wrote[/] {value} (push with: moetool push {value} --repo-id YOU/NAME)")


@friendly
def build(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Run directory (merged/, tuned/, exports/, hf-repo/).")
    ],
    train: Annotated[
        bool | None, typer.Option("--train/--no-train", help="Tune routers (default: when the recipe has train:).")
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(min=1, help="Held-out tokens per domain in the evaluation (default 8192).")
    ] = None,
    tasks: Annotated[
        str | None, typer.Option(help="lm-eval tasks to score too (comma-separated; 'local': one per zoo domain).")
    ] = None,
    task_limit: Annotated[int | None, typer.Option(min=1, help="Documents per lm-eval task.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace existing outputs.")] = False,
) -> None:
    """The recipe's whole pipeline: merge → tune (if asked) → evaluate → export every `targets:` entry → package."""
    from moetool import api

    res = api.build(
        recipe, output, tune=train, max_tokens=max_tokens, tasks=[t for t in (tasks or "").split(",") if t] or None,
        task_limit=task_limit, force=force, console=console, on_stage=_printer,
    )  # fmt: skip
    _report_failures(res.failed)


def _report_failures(failed: list[str]) -> None:
    """End a build whose optional steps failed with their reasons and exit status 1 (everything else was written)."""
    if not failed:
        return
    console.print(f"[red]{len(failed)} optional step(s) failed; every other stage finished:[/]")
    for why in failed:
        console.print(f"  - {why}", highlight=False)
    raise typer.Exit(1)


_DEMO_RECIPES = {"smollm2": "recipes/real-mofe.yaml", "default": "recipes/demo-mofe.yaml"}


@friendly
def demo(
    output: Annotated[Path, typer.Option(help="Directory for the demo's models and report.")] = Path("out/demo"),
    profile: Annotated[
        str,
        typer.Option(help="smollm2: the real SmolLM2-135M zoo (default); tiny: the 1.3M-parameter toy zoo (fast)."),
    ] = "smollm2",
    recipe: Annotated[
        Path | None,
        typer.Option(help="Recipe to merge and tune (default: recipes/real-mofe.yaml, or demo-mofe.yaml for tiny)."),
    ] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="Held-out tokens per domain in the evaluation.")] = None,
    task_limit: Annotated[
        int | None, typer.Option(min=1, help="Documents per local lm-eval task (default: 50 on smollm2, all on tiny).")
    ] = None,
) -> None:
    """Zoo → merge → router tuning → evaluation with a verdict → verified GGUF for a Raspberry Pi → HF repo folder →
    one question per domain, answered by the MoE in transformers and by the GGUF in llama.cpp."""
    from rich.markup import escape

    from moetool import api
    from moetool.cli.render import acceptance, print_answers
    from moetool.errors import MoetoolError
    from moetool.extras import install_hint
    from moetool.recipe.mofe import MoFERecipe
    from moetool.zoo import SMOLLM2, build_zoo
    from moetool.zoo.smollm2 import build_smollm2

    real = profile == SMOLLM2
    if profile not in (SMOLLM2, "tiny", "default"):
        raise MoetoolError(f"--profile: unknown profile {profile!r} (smollm2, or tiny for the toy zoo)")
    if real:
        build_smollm2(console=console)
    else:
        build_zoo("default", console=console)  # the toy zoo the demo recipes name (zoo:base, zoo:code, ...)
    r = api.load(recipe or Path(_DEMO_RECIPES[SMOLLM2 if real else "default"]))
    if not isinstance(r, MoFERecipe):  # the demo merges experts of a base: a mofe recipe
        raise MoetoolError(f"--recipe {recipe}: method is {r.method!r}; the demo runs a mofe recipe")
    verify = importlib.util.find_spec("llama_cpp") is not None
    if not verify:
        console.print(
            f"[yellow]llama-cpp-python is not installed ({escape(install_hint('llama'))}): the GGUF is written but "
            "not checked in llama.cpp[/]"
        )
    tasks = ["local"] if importlib.util.find_spec("lm_eval") is not None else None
    if tasks is None:
        console.print(f"[yellow]lm-eval is not installed ({escape(install_hint('eval'))}): no task accuracy[/]")
    res = api.build(
        r, output, presets=["mofe"] if real else ["router_only", "mofe"],
        compare=[r.base_model, *[e.source for e in r.experts]], profiles=["raspberry-pi-4"],
        max_tokens=max_tokens or (4096 if real else 16384), tasks=tasks,
        task_limit=task_limit or (50 if real else None), force=True, verify=verify, console=console,
        on_stage=_printer,
    )  # fmt: skip
    if res.report is not None:
        acceptance(res.report, [str(res.merged), *[str(p) for p in res.tuned.values()]])
    if res.answers:
        print_answers(res.answers)
    _report_failures(res.failed)


def register(app: typer.Typer) -> None:
    app.command()(build)
    app.command()(demo)
