"""``moetool experts``: list, add, remove, prune and extract the experts of an existing MoE (:mod:`moetool.api.experts`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypedDict

import typer
from rich.console import Console

from moetool.cli.console import console, friendly, out
from moetool.cli.options import JsonOpt, VerifyOpt, old_spelling

if TYPE_CHECKING:
    from moetool.edit.run import EditResult
    from moetool.edit.tune import Recalibration

app = typer.Typer(
    no_args_is_help=True, help="Edit an MoE after it is built: list, add, remove, prune, extract experts."
)

Output = Annotated[Path, typer.Option("-o", "--output", help="Directory to write (written atomically).")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing output.")]
Data = Annotated[
    list[str] | None, typer.Option("--data", help="NAME=FILE or NAME=zoo:DOMAIN: calibration / tuning text (repeat).")
]
TuneSteps = Annotated[
    int, typer.Option("--tune-steps", min=0, help="Router-only recalibration steps on --data after the edit (0: none).")
]
RouterLR = Annotated[float, typer.Option("--router-lr", min=0.0, help="Recalibration learning rate of the routers.")]
TopK = Annotated[int | None, typer.Option("--top-k", min=1, help="New experts-per-token (default: kept).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print what the edit would write; write nothing.")]
OldNoCheck = Annotated[bool, typer.Option("--no-check", hidden=True, help="The old spelling of --no-verify.")]
Dtype = Annotated[str, typer.Option(help="auto (the checkpoint's own), float32, bfloat16 or float16.")]
Device = Annotated[str, typer.Option(help="auto (a GPU when there is one), cpu, cuda or cuda:N.")]


def _data(items: list[str] | None) -> dict[str, str]:
    pairs = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep:  # a bare FILE is named after itself
            name, value = Path(item).stem, item
        if not name or not value:
            raise typer.BadParameter(f"{item!r} is not NAME=FILE", param_hint="--data")
        pairs[name] = value
    return pairs


class _Write(TypedDict):
    """What every edit takes: how it writes and checks its output."""

    force: bool
    verify: bool
    dry_run: bool
    console: Console


class _Tuned(_Write):
    """What the edits that recalibrate the routers take besides: the data and where they compute."""

    tune: Recalibration
    data: dict[str, str]
    dtype: str
    device: str


def _write(command: str, verify: bool, old_no_check: bool, dry_run: bool, force: bool) -> _Write:
    """The output options of ``moetool experts COMMAND`` (``--no-check``: the old spelling of ``--no-verify``)."""
    skip = old_spelling(f"experts {command}", "--no-check", True if old_no_check else None, None if verify else True)
    return _Write(force=force, verify=not skip, dry_run=dry_run, console=console)


def _tuned(
    write: _Write, data: list[str] | None, steps: int, lr: float, dtype: str, device: str, seed: int = 0
) -> _Tuned:
    """``write`` and the recalibration options of an edit that tunes the routers after."""
    from moetool.edit.tune import Recalibration

    tune = Recalibration(steps=steps, router_learning_rate=lr, seed=seed)
    return _Tuned(**write, tune=tune, data=_data(data), dtype=dtype, device=device)


def _report(result: EditResult, dry_run: bool = False) -> None:
    if dry_run:
        from moetool.cli.render import print_edit_plan

        print_edit_plan(out, result.plan)
        return
    record = result.plan.record
    out.print(f"{record['summary']}")
    for key, value in result.parity.items():
        if isinstance(value, float) and key != "tolerance":
            out.print(f"  parity {key}: max |Δlogit| {value:.2e} (tolerance {result.parity['tolerance']:g})")
    if result.tuned:
        out.print("  routers recalibrated (router-only tuning)")
    out.print(f"wrote {result.output}")


@app.command("list")
@friendly
def list_cmd(
    moe: Annotated[Path, typer.Argument(help="MoE folder.")],
    data: Data = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Calibration tokens per --data text.")] = 8192,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the listing as JSON to this file.")
    ] = None,
    as_json: JsonOpt = False,
    dtype: Dtype = "auto",
    device: Device = "auto",
) -> None:
    """The experts (index, name) and, with --data, each one's routing share and REAP saliency per layer."""
    import json
    import sys

    from moetool import api
    from moetool.cli.render import experts_table

    report = api.experts.listing(
        moe, _data(data), max_tokens=max_tokens, dtype=dtype, device=device, console=console, json_file=output
    )
    if as_json:  # stdout carries the JSON only
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        experts_table(out, report)
    if output is not None:
        (console if as_json else out).print(f"wrote {output}")


@app.command("remove")
@friendly
def remove_cmd(
    moe: Annotated[Path, typer.Argument(help="MoE folder.")],
    experts: Annotated[list[str], typer.Argument(help="Expert names or indices to remove.")],
    output: Output,
    top_k: TopK = None,
    data: Data = None,
    tune_steps: TuneSteps = 0,
    router_lr: RouterLR = 0.05,
    verify: VerifyOpt = True,
    old_no_check: OldNoCheck = False,
    dry_run: DryRun = False,
    force: Force = False,
    dtype: Dtype = "auto",
    device: Device = "auto",
) -> None:
    """Remove experts from every MoE layer; every other tensor is kept bit for bit."""
    from moetool import api

    write = _write("remove", verify, old_no_check, dry_run, force)
    tuned = _tuned(write, data, tune_steps, router_lr, dtype, device)
    _report(api.experts.remove(moe, experts, output, top_k=top_k, **tuned), dry_run)


@app.command("prune")
@friendly
def prune_cmd(
    moe: Annotated[Path, typer.Argument(help="MoE folder.")],
    output: Output,
    keep: Annotated[float, typer.Option(help="Experts to keep per layer, or a fraction below 1.")],
    data: Data = None,
    by: Annotated[str, typer.Option(help="reap (gate × output norm), frequency or random.")] = "reap",
    per_layer: Annotated[bool, typer.Option("--per-layer", help="Each layer keeps its own best experts.")] = False,
    power_of_two: Annotated[
        bool, typer.Option("--power-of-two", help="Round the budget down to a power of two.")
    ] = False,
    top_k: TopK = None,
    seed: Annotated[int, typer.Option(help="Seed of --by random and of recalibration.")] = 0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Calibration tokens per --data text.")] = 8192,
    tune_steps: TuneSteps = 0,
    router_lr: RouterLR = 0.05,
    verify: VerifyOpt = True,
    old_no_check: OldNoCheck = False,
    dry_run: DryRun = False,
    force: Force = False,
    dtype: Dtype = "auto",
    device: Device = "auto",
) -> None:
    """Keep N experts per layer, scored on calibration text; optionally recalibrate the routers after."""
    from moetool import api

    result = api.experts.prune(
        moe,
        output,
        keep=keep,
        by=by,
        per_layer=per_layer,
        power_of_two=power_of_two,
        top_k=top_k,
        seed=seed,
        max_tokens=max_tokens,
        **_tuned(
            _write("prune", verify, old_no_check, dry_run, force), data, tune_steps, router_lr, dtype, device, seed
        ),
    )
    for row in result.plan.record["layers"]:
        scores = ", ".join(f"{n} {s:.3g}" for n, s in row["scores"].items())
        out.print(f"  layer {row['layer']}: kept {', '.join(row['kept'])} ({scores})", highlight=False)
    _report(result, dry_run)


@app.command("add")
@friendly
def add_cmd(
    moe: Annotated[Path, typer.Argument(help="MoE folder.")],
    source: Annotated[
        str,
        typer.Option(
            help="Dense expert of the MoE's base (folder, zoo:NAME or cached Hub id), or a LoRA adapter folder."
        ),
    ],
    name: Annotated[str, typer.Option(help="The new expert's name.")],
    output: Output,
    prompt: Annotated[list[str], typer.Option("--prompt", help="Text the new expert should receive (repeat).")],
    negative_prompt: Annotated[
        list[str] | None, typer.Option("--negative-prompt", help="Text it should not receive (repeat).")
    ] = None,
    base: Annotated[Path | None, typer.Option(help="A LoRA source's dense base (default: from its config).")] = None,
    chat_template: Annotated[bool, typer.Option(help="Prompts through the tokenizer's chat template.")] = False,
    data: Data = None,
    tune_steps: TuneSteps = 0,
    router_lr: RouterLR = 0.05,
    verify: VerifyOpt = True,
    old_no_check: OldNoCheck = False,
    dry_run: DryRun = False,
    force: Force = False,
    dtype: Dtype = "auto",
    device: Device = "auto",
) -> None:
    """Add a dense expert (or a baked LoRA adapter) as one more expert in every MoE layer; top-k is kept."""
    from moetool import api

    tuned = _tuned(_write("add", verify, old_no_check, dry_run, force), data, tune_steps, router_lr, dtype, device)
    result = api.experts.add(
        moe, source, output, name=name, prompts=prompt, negative=negative_prompt, base=base,
        chat_template=chat_template, **tuned,
    )  # fmt: skip
    _report(result, dry_run)


@app.command("extract")
@friendly
def extract_cmd(
    moe: Annotated[Path, typer.Argument(help="MoE folder.")],
    expert: Annotated[str, typer.Argument(help="Expert name, index, or 'shared'.")],
    output: Output,
    verify: VerifyOpt = True,
    old_no_check: OldNoCheck = False,
    dry_run: DryRun = False,
    force: Force = False,
) -> None:
    """One expert as a dense model of the base family (a moetool-built MoE gives back the source, bit for bit)."""
    from moetool import api

    _report(api.experts.extract(moe, expert, output, **_write("extract", verify, old_no_check, dry_run, force)))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="experts")


__all__: list[str] = ["app", "register"]
