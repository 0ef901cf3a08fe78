"""``moetool eval``: held-out perplexity per domain, routing statistics and GEM metrics, side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from moetool.cli.console import console, friendly, out
from moetool.cli.options import JsonOpt, old_spelling


@friendly
def eval_cmd(
    models: Annotated[list[str], typer.Argument(help="Model directories or zoo:NAME references.")],
    domains: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated domains (default: the --data names if any, else the zoo's code,legal,medical)."
        ),
    ] = None,
    data: Annotated[
        list[str] | None, typer.Option(help="DOMAIN=FILE: held-out text for a domain (overrides the zoo's).")
    ] = None,
    own: Annotated[list[str] | None, typer.Option(help="MODEL=DOMAIN: a model's own domain for GG/DSI.")] = None,
    seq_len: Annotated[int, typer.Option(min=2, help="Window length in tokens.")] = 256,
    max_tokens: Annotated[int, typer.Option(min=1, help="Held-out tokens per domain.")] = 32768,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the full report as JSON to this file.")
    ] = None,
    as_json: JsonOpt = False,
    plots: Annotated[Path | None, typer.Option(help="Directory for PNG plots.")] = None,
    tasks: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated lm-evaluation-harness tasks: lm-eval names (datasets from the local cache), "
            "'local' (a continuation task per domain, built from the held-out text) or moetool_cont_DOMAIN."
        ),
    ] = None,
    task_limit: Annotated[
        int | None, typer.Option(min=1, help="Documents per lm-eval task (all when not given).")
    ] = None,
    num_fewshot: Annotated[int | None, typer.Option(min=0, help="Few-shot examples per prompt (task default).")] = None,
    dtype: Annotated[
        str, typer.Option(help="auto (each model's own dtype, nothing upcast), float32, bfloat16 or float16.")
    ] = "auto",
    device: Annotated[str, typer.Option(help="auto (a GPU when there is one), cpu, cuda or cuda:N.")] = "auto",
    old_limit: Annotated[
        int | None, typer.Option("--limit", min=1, hidden=True, help="The old spelling of --task-limit.")
    ] = None,
) -> None:
    """Per-domain held-out perplexity, routing statistics and GEM metrics for every model given; with --tasks,
    lm-evaluation-harness task scores side by side."""
    from moetool import api
    from moetool.cli.render import print_report
    from moetool.errors import MoetoolError

    files = {d: Path(f) for d, f in (_pair("--data", "DOMAIN=FILE", item) for item in (data or []))}
    owners = dict(_pair("--own", "MODEL=DOMAIN", x) for x in (own or []))
    limit = old_spelling("eval", "--limit", old_limit, task_limit)
    model_dirs = [Path(m) for m in models if not m.startswith("zoo:")]
    api.check_report_outputs(output, plots, [*files.values(), *model_dirs])
    report = api.evaluate(
        models, domains=None if domains is None else [d for d in domains.split(",") if d], data=files, own=owners,
        seq_len=seq_len, max_tokens=max_tokens, tasks=[t for t in (tasks or "").split(",") if t] or None,
        limit=limit, num_fewshot=num_fewshot, dtype=dtype, device=device,
        on_model=(lambda m: console.print(f"lm-eval tasks: {m} …")) if tasks else None,
    )  # fmt: skip
    said = console if as_json else out  # with --json, stdout carries the JSON only
    if not as_json:
        print_report(report)
    for name, held in report["models"].items():
        if "streamed" in held:
            said.print(f"{name}: streamed from disk, {held['streamed']}", highlight=False)
    bad = api.nonfinite_figures(report)
    if bad:  # api.evaluate refuses a NaN model itself; a report with a meaningless figure is never written either
        raise MoetoolError(
            f"perplexity is not finite for {', '.join(bad)}: the model computes NaN or overflows (check its weights "
            "with `moetool inspect`); no report written"
        )
    for path in api.write_report(report, output, plots):
        said.print(f"wrote {path}")
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")


def _pair(option: str, form: str, item: str) -> tuple[str, str]:
    """``NAME=VALUE`` of a repeated option, both sides non-empty."""
    name, sep, value = item.partition("=")
    if not sep or not name or not value:
        raise typer.BadParameter(f"{item!r} is not {form}", param_hint=option)
    return name, value


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
