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
        print_export_plan(exporter, plan, f"{exporter.name} plan '{plan.quant.label}' for {plan.name} ({dir_name})")
    elif name == "exported":
        print_manifest(*value)
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
    max_tokens: Annotated[int, typer.Option(help="Held-out tokens per domain in the evaluation.")] = 8192,
    force: Annotated[bool, typer.Option("--force", help="Replace existing outputs.")] = False,
) -> None:
    """The recipe's whole pipeline: merge → tune (if asked) → evaluate → export every `targets:` entry → package."""
    from moetool import api

    api.build(recipe, output, tune=train, max_tokens=max_tokens, force=force, console=console, on_stage=_printer)


@friendly
def demo(
    output: Annotated[Path, typer.Option(help="Directory for the demo's models and report.")] = Path("out/demo"),
    recipe: Annotated[Path, typer.Option(help="Recipe to merge and tune.")] = Path("recipes/demo-mofe.yaml"),
    max_tokens: Annotated[int, typer.Option(help="Held-out tokens per domain in the evaluation.")] = 16384,
) -> None:
    """Zoo → merge → router tuning (two presets) → evaluation with a verdict → verified GGUF for a Raspberry Pi →
    HF repo folder."""
    from rich.markup import escape

    from moetool import api
    from moetool.cli.render import acceptance
    from moetool.extras import install_hint
    from moetool.zoo import build_zoo

    build_zoo("default", console=console)
    r: Any = api.load(recipe)
    verify = importlib.util.find_spec("llama_cpp") is not None
    if not verify:
        console.print(
            f"[yellow]llama-cpp-python is not installed ({escape(install_hint('llama'))}): the GGUF is written but "
            "not checked in llama.cpp[/]"
        )
    res = api.build(
        r, output, presets=["router_only", "mofe"], compare=["zoo:base", *[e.source for e in r.experts]],
        devices=["raspberry-pi-4"], max_tokens=max_tokens, force=True, verify=verify, console=console,
        on_stage=_printer,
    )  # fmt: skip
    if res.report is not None:
        acceptance(res.report, [str(res.merged), *[str(p) for p in res.tuned.values()]])


def register(app: typer.Typer) -> None:
    app.command()(build)
    app.command()(demo)
