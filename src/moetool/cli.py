"""The ``moetool`` command line: thin Typer commands over :mod:`moetool.api`."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moetool.errors import MoetoolError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Turn domain experts into one Mixture-of-Experts model: merge, inspect, evaluate.",
)
zoo_app = typer.Typer(no_args_is_help=True, help="The self-trained demo zoo of domain experts.")
app.add_typer(zoo_app, name="zoo")
console = Console(stderr=True)
out = Console()

F = TypeVar("F", bound=Callable[..., Any])


def _friendly(fn: F) -> F:
    """Turn user errors into one red message and exit code 2 (no traceback)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MoetoolError as exc:
            console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


@app.command()
@_friendly
def validate(recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")]) -> None:
    """Validate a recipe file (no model is read)."""
    from moetool.recipe import load_recipe

    r: Any = load_recipe(recipe)
    out.print(f"[green]ok[/]: {recipe} (method: {r.method}, name: {r.name})")


@app.command()
def schema() -> None:
    """Print the JSON schema of recipe files."""
    from moetool.recipe.load import dump_schema

    sys.stdout.write(dump_schema() + "\n")


def print_plan(plan: Any) -> None:
    by_kind = plan.bytes_by_kind()
    t = Table(title=f"merge plan: {plan.recipe.name} → {plan.arch.name} ({plan.dtype})")
    for col in ("tensor", "kind", "source", "shape"):
        t.add_column(col)
    shown = [op for op in plan.ops if ".layers." not in op.out or ".layers.0." in op.out]
    for op in shown:
        t.add_row(op.out, op.kind, op.source or "(computed)", "×".join(map(str, op.shape)))
    out.print(t)
    layers = plan.config["num_hidden_layers"]
    if layers > 1:
        out.print(f"(layers 1–{layers - 1} repeat layer 0's pattern)")
    s = Table(title="bytes by kind")
    s.add_column("kind")
    s.add_column("bytes", justify="right")
    for k, v in by_kind.items():
        s.add_row(k, _human(v))
    s.add_row("[bold]total[/]", f"[bold]{_human(plan.total_bytes)}[/] in {len(plan.ops)} tensors")
    out.print(s)
    hidden = plan.recipe.gate_mode == "hidden"
    out.print(
        f"peak memory estimate: {_human(plan.peak_memory_estimate())}"
        + (" (the base model loaded once for hidden gates, freed before tensors stream)" if hidden else "")
    )
    for w in plan.warnings:
        out.print(f"[yellow]warning:[/] {w}")


@app.command()
@_friendly
def merge(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output directory.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; read no weights, write nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Accept pytorch_model*.bin inputs.")] = False,
) -> None:
    """Merge experts into one MoE checkpoint as the recipe says."""
    from moetool.api import assembler_for, plan_merge
    from moetool.merge import execute

    assembler, r = assembler_for(recipe)
    if assembler is not None:
        if dry_run:
            out.print(assembler.describe(r, recipe_dir=recipe.parent))
            return
        if output is None:
            raise MoetoolError("--output is required (or use --dry-run)")
        path = assembler.assemble(r, recipe_dir=recipe.parent, output=output, force=force, console=console)
        out.print(f"[green]wrote[/] {path} ({assembler.name})")
        return
    plan = plan_merge(recipe, allow_pickle=allow_pickle)
    if dry_run:
        print_plan(plan)
        return
    if output is None:
        raise MoetoolError("--output is required (or use --dry-run)")
    path = execute(plan, output, force=force, recipe_text=recipe.read_text(encoding="utf-8"), console=console)
    out.print(f"[green]wrote[/] {path} ({plan.arch.name}, {len(plan.recipe.experts)} experts)")


@app.command()
@_friendly
def inspect(
    model: Annotated[Path, typer.Argument(help="Checkpoint directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Architecture, experts, routers, total and active parameters, size on disk."""
    from moetool.inspect import inspect_model

    info = inspect_model(model)
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        return
    t = Table(title=str(model), show_header=False)
    for k, v in info.items():
        if k in ("total_params", "active_params_per_token"):
            v = f"{v:,}"
        elif k == "size_on_disk_bytes":
            v = _human(v)
        t.add_row(k, str(v))
    out.print(t)


@zoo_app.command("build")
@_friendly
def zoo_build(
    profile: Annotated[str, typer.Option(help="Zoo profile: default or tiny.")] = "default",
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if cached.")] = False,
) -> None:
    """Train the base LM and one expert per domain on text already on this machine (cached)."""
    from moetool.zoo import build_zoo

    res = build_zoo(profile, force=force, console=console)
    out.print(f"[green]zoo ready[/] at {res.root}")


def _own_domain(ref: str, path: Path, domains: list[str]) -> str | None:
    """An expert's own domain: ``zoo:DOMAIN`` or a directory named after a domain."""
    name = ref.removeprefix("zoo:") if ref.startswith("zoo:") else path.name
    return name if name in domains else None


@app.command("eval")
@_friendly
def eval_cmd(
    models: Annotated[list[str], typer.Argument(help="Model directories or zoo:NAME references.")],
    domains: Annotated[str, typer.Option(help="Comma-separated zoo domains.")] = "code,legal,medical",
    data: Annotated[
        list[str] | None, typer.Option(help="DOMAIN=FILE: held-out text for a domain (overrides the zoo's).")
    ] = None,
    own: Annotated[list[str] | None, typer.Option(help="MODEL=DOMAIN: a model's own domain for GG/DSI.")] = None,
    seq_len: Annotated[int, typer.Option(help="Window length in tokens.")] = 256,
    max_tokens: Annotated[int, typer.Option(help="Held-out tokens per domain.")] = 32768,
    json_file: Annotated[Path | None, typer.Option("--json", help="Write the full report as JSON.")] = None,
    plots: Annotated[Path | None, typer.Option(help="Directory for PNG plots.")] = None,
) -> dict[str, Any]:
    """Per-domain held-out perplexity, routing statistics and GEM metrics for every model given."""
    from moetool.eval.plots import write_plots
    from moetool.eval.report import evaluate
    from moetool.io.sources import resolve_source

    names = [d for d in domains.split(",") if d]
    files = dict(item.split("=", 1) for item in (data or []))
    texts = {}
    for d in names:
        if d in files:
            texts[d] = Path(files[d]).read_text(encoding="utf-8")
        else:
            from moetool.zoo import zoo_domain_text

            texts[d] = zoo_domain_text(d, "valid")
    paths = {m: resolve_source(m).path for m in models}
    owners = {m: _own_domain(m, p, names) for m, p in paths.items()} | dict(x.split("=", 1) for x in (own or []))
    report = evaluate(paths, texts, own_domains=owners, seq_len=seq_len, max_tokens=max_tokens)
    print_report(report)
    if json_file:
        json_file.parent.mkdir(parents=True, exist_ok=True)
        json_file.write_text(json.dumps(report, indent=2))
        out.print(f"wrote {json_file}")
    if plots:
        for p in write_plots(report, plots):
            out.print(f"wrote {p}")
    return report


def print_report(report: dict[str, Any]) -> None:
    from moetool.eval.perplexity import render_matrix

    matrix = {m: dict(row) | {"mean": sum(row.values()) / len(row)} for m, row in report["perplexity"].items()}
    out.print(render_matrix(matrix, "held-out perplexity (lower is better)"))
    g = Table(title="GEM metrics (Perf = 1/perplexity)")
    for col in ("model", "own domain", "GG", "DSI"):
        g.add_column(col, justify="right" if col in ("GG", "DSI") else "left")
    for m, v in report["gem"].items():
        g.add_row(m, v["own_domain"] or "(general: mean over domains)", f"{v['gg']:.3f}", f"{v['dsi']:.3f}")
    out.print(g)
    for m, r in report["routing"].items():
        experts = r["experts"] or [str(i) for i in range(len(next(iter(r["per_domain"].values()))["expert_share"][0]))]
        t = Table(title=f"routing of {m}: share of top-k assignments (mean over layers) and entropy")
        t.add_column("text")
        for e in experts:
            t.add_column(e, justify="right")
        t.add_column("entropy", justify="right")
        for d, st in r["per_domain"].items():
            layers = st["expert_share"]
            mean = [sum(layer[i] for layer in layers) / len(layers) for i in range(len(experts))]
            t.add_row(d, *[f"{x:.2f}" for x in mean], f"{sum(st['entropy']) / len(st['entropy']):.2f}")
        out.print(t)


@app.command()
@_friendly
def train(
    recipe: Annotated[Path, typer.Argument(help="Recipe with freeze: and train: sections.")],
    model: Annotated[Path, typer.Option("--model", help="The merged MoE to tune.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory.")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="Ignore a checkpoint of an interrupted run.")] = False,
    preset: Annotated[str | None, typer.Option(help="Override freeze.preset: mofe, router_only or full.")] = None,
) -> None:
    """Tune routers (and what else the freeze spec allows) with the experts frozen; resumable."""
    from moetool.train.router_tuning import train_router

    res = train_router(recipe, model, output, force=force, resume=not no_resume, console=console, preset=preset)
    out.print(f"[green]wrote[/] {res.output} ({res.steps} steps in {res.seconds:.0f} s)")


def acceptance(report: dict[str, Any], candidates: list[str], tolerance: float = 0.05) -> bool:
    """Print whether each MoE is within ``tolerance`` of the best expert on every domain and beats every expert's
    mean; return True if the last candidate passes."""
    ppl = report["perplexity"]
    experts = [m for m, v in report["models"].items() if v["own_domain"]]
    domains = report["domains"]
    best = {d: min(ppl[e][d] for e in experts) for d in domains}
    best_mean = min(sum(ppl[e].values()) / len(domains) for e in experts)
    t = Table(title=f"acceptance: within {tolerance:.0%} of the best expert on every domain, mean below every expert's")
    for col in ("model", *[f"{d} / best" for d in domains], "mean / best expert mean", "verdict"):
        t.add_column(col, justify="right" if col != "model" else "left")
    ok = False
    for m in candidates:
        ratios = [ppl[m][d] / best[d] for d in domains]
        mean_ratio = sum(ppl[m].values()) / len(domains) / best_mean
        ok = all(r <= 1 + tolerance for r in ratios) and mean_ratio < 1
        verdict = "[green]PASS[/]" if ok else "[red]FAIL[/]"
        t.add_row(m, *[f"{r:.3f}" for r in ratios], f"{mean_ratio:.3f}", verdict)
    out.print(t)
    return ok


@app.command()
@_friendly
def demo(
    output: Annotated[Path, typer.Option(help="Directory for the demo's models and report.")] = Path("out/demo"),
    recipe: Annotated[Path, typer.Option(help="Recipe to merge and tune.")] = Path("recipes/demo-mofe.yaml"),
    max_tokens: Annotated[int, typer.Option(help="Held-out tokens per domain in the evaluation.")] = 16384,
) -> None:
    """Zoo → merge → router tuning → evaluation with a verdict → verified GGUF for a Raspberry Pi → HF repo folder."""
    from moetool.recipe import load_recipe
    from moetool.train.router_tuning import train_router
    from moetool.zoo import build_zoo

    build_zoo("default", console=console)
    merged = output / "merged"
    merge(recipe, output=merged, dry_run=False, force=True, allow_pickle=False)
    inspect(merged, as_json=False)
    tuned = []
    for preset in ("router_only", "mofe"):
        path = output / f"tuned-{preset}"
        console.rule(f"router tuning, freeze preset {preset}")
        res = train_router(recipe, merged, path, force=True, resume=False, console=console, preset=preset)
        out.print(f"{preset}: {res.freeze.trainable_params:,} trainable parameters, {res.seconds:.0f} s")
        tuned.append(str(path))
    r: Any = load_recipe(recipe)
    names = ["zoo:base", *[e.source for e in r.experts], str(merged), *tuned]
    report = eval_cmd(
        names,
        domains=",".join(r.train.data),
        data=None,
        own=None,
        seq_len=256,
        max_tokens=max_tokens,
        json_file=output / "eval.json",
        plots=output / "plots",
    )
    acceptance(report, [str(merged), *tuned])

    import importlib.util

    from moetool.api import plan_export
    from moetool.package import build_repo

    verify = importlib.util.find_spec("llama_cpp") is not None
    best = Path(tuned[-1])
    for dev in ("raspberry-pi-4",):
        console.rule(f"GGUF export for {dev} (plan from the recipe's quantization section)")
        exporter, req, plan = plan_export(best, output / "exports" / dev, device=dev, force=True, verify=verify)
        print_quant_plan(plan, f"{exporter.name} plan '{plan.quant.label}' for {plan.name} on {dev}")
        if not verify:
            console.print(
                "[yellow]llama-cpp-python is not installed (bash scripts/setup.sh --llama): the GGUF is "
                "written but not checked in llama.cpp[/]"
            )
        with console.status("writing and verifying …"):
            manifest = exporter.export(req, plan, console=console)
        out.print(f"[green]wrote[/] {req.output / manifest['file']} ({_human(manifest['artifact']['bytes'])})")
        _print_parity(manifest["parity"])
    console.rule("Hugging Face repo folder")
    repo = build_repo(output, output / "hf-repo", force=True)
    out.print(f"[green]wrote[/] {repo} (push with: moetool push {repo} --repo-id YOU/NAME)")


def print_quant_plan(plan: Any, title: str) -> None:
    """Bytes per role and the total: printed before anything is written."""
    q = plan.quant
    t = Table(title=title)
    for col in ("role", "parameters", "types", "bytes"):
        t.add_column(col, justify="right" if col in ("parameters", "bytes") else "left")
    for role, row in q.by_role().items():
        types = ", ".join(f"{ty}×{n}" for ty, n in row["types"].items())
        t.add_row(role, f"{row['params']:,}", types, _human(row["bytes"]))
    t.add_row(
        "[bold]total[/]", f"{q.total_params:,}", f"{q.bpw():.2f} bits/weight", f"[bold]{_human(q.total_bytes)}[/]"
    )
    out.print(t)
    for note in q.notes():
        out.print(f"[yellow]note[/]: {escape(note)}")
    if plan.memory is not None:
        m = plan.memory
        line = (
            f"memory at {plan.context} tokens: weights {_human(m.weights)} + KV cache {_human(m.kv_cache)} + "
            f"runtime {_human(m.runtime)} = {_human(m.total)}"
        )
        if plan.device:
            from moetool.quant.devices import get_device

            line += f" (budget on {plan.device}: {_human(get_device(plan.device).budget)})"
        out.print(line)
    for label, total, fits in getattr(plan, "candidates", []):
        mark = "[green]fits[/]" if fits else "[red]too big or unsupported[/]"
        out.print(f"  plan {label}: {_human(total)} {mark}{'  ← chosen' if label == q.label else ''}")


@app.command("export")
@_friendly
def export_cmd(
    model: Annotated[str, typer.Argument(help="Model directory (merged or tuned), or zoo:NAME.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Artifact directory (artifact + manifest.json).")],
    target: Annotated[
        str | None,
        typer.Option(help="gguf, onnx, tflite, coreml or executorch (default: gguf, or the device's first format)."),
    ] = None,
    quant: Annotated[
        str | None,
        typer.Option(
            help="Preset (gem, moe-q4, …), type (q8_0, …) or rules 'experts=q4_k,attention=q8_0,*=q8_0'. Default: the recipe's quantization section, else f16."
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="Device profile (`moetool devices`): picks format and the best plan that fits.")
    ] = None,
    context: Annotated[int | None, typer.Option(help="Context length for the memory estimate.")] = None,
    eval_text: Annotated[Path | None, typer.Option(help="Held-out text file for the parity check.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan and memory estimate; write nothing.")
    ] = False,
    verify: Annotated[bool, typer.Option(help="Check the artifact in its runtime against transformers.")] = True,
    compute_units: Annotated[
        str, typer.Option(help="Core ML: ALL, CPU_ONLY, CPU_AND_GPU or CPU_AND_NE.")
    ] = "CPU_AND_NE",
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    base: Annotated[
        str | None,
        typer.Option(
            help="Base model of a PEFT adapter given as MODEL (default: the adapter's base_model_name_or_path)."
        ),
    ] = None,
) -> None:
    """Export a model for a device, with a per-tensor precision plan, verified in the target runtime.

    Given a PEFT LoRA adapter directory, writes a GGUF adapter for llama.cpp's --lora, checked against the base
    with the adapter merged in.
    """
    from moetool.api import export, plan_export
    from moetool.export.gguf.lora import is_adapter

    text = eval_text.read_text(encoding="utf-8") if eval_text else None
    if is_adapter(Path(model)):
        if dry_run:
            raise typer.BadParameter("--dry-run is for models, not adapters")
        with console.status("writing and verifying the GGUF adapter …"):
            manifest = export(model, output, base=base, quant=quant, force=force, verify=verify, eval_text=text)
        out.print(f"[green]wrote[/] {output / manifest['file']} ({_human(manifest['artifact']['bytes'])})")
        _print_parity(manifest["parity"])
        return
    exporter, req, plan = plan_export(
        model,
        output,
        target=target if target or device else "gguf",
        quant=quant,
        device=device,
        force=force,
        verify=verify,
        eval_text=text,
        context=context,
    )
    req.options["compute_units"] = compute_units
    print_quant_plan(plan, f"{exporter.name} plan '{plan.quant.label}' for {plan.name}")
    if dry_run:
        return
    from moetool.io.atomic import check_output

    check_output(output, force=force)
    with console.status(f"writing and verifying {exporter.name} …"):
        manifest = exporter.export(req, plan, console=console)
    out.print(f"[green]wrote[/] {output / manifest['file']} ({_human(manifest['artifact']['bytes'])})")
    _print_parity(manifest["parity"])


def _print_parity(p: Any) -> None:
    if isinstance(p, dict):
        diffs = ", ".join(f"seq {k}: {v:.2e}" for k, v in p["max_abs_logit_diff"].items())
        line = (
            f"parity ({p['runtime']} vs {p['reference']}, {p.get('text', '?')} text): max |Δlogit| {diffs}; top-1 "
            f"agreement {p['top1_agreement']:.4f}; perplexity {p['ppl_reference']:.3f} → {p['ppl_artifact']:.3f} "
            f"({100 * p['ppl_change']:+.2f}%)"
        )
        if "conversion" in p:
            conv = p["conversion"]
            worst = max(conv["max_abs_logit_diff"].values())
            line += f"; conversion alone (artifact's own weights): max |Δlogit| {worst:.2e}, top-1 {conv['top1_agreement']:.4f}"
        if "decode" in p:
            line += f"; decode with KV cache: max |Δlogit| {p['decode']['max_abs_logit_diff']:.2e}"
        if "tokenizer_match" in p:
            line += f"; tokenizer {'matches' if p['tokenizer_match'] else 'DIFFERS'} on {p['tokenizer_probes']} probes"
        out.print(line, highlight=False)
    else:
        out.print(f"[yellow]{p}[/]")


@app.command()
def devices(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """Device profiles: memory budget, formats in order of preference, precisions, plans tried."""
    from dataclasses import asdict

    from moetool.quant.devices import DEVICES

    if as_json:
        sys.stdout.write(json.dumps({n: asdict(d) for n, d in DEVICES.items()}, indent=2) + "\n")
        return
    t = Table(title="device profiles")
    for col in ("device", "memory", "budget", "formats", "plans tried (best first)", "note"):
        t.add_column(col)
    for d in DEVICES.values():
        t.add_row(d.name, _human(d.memory), _human(d.budget), ", ".join(d.formats), ", ".join(d.ladder), d.note)
    out.print(t)


@app.command()
def presets() -> None:
    """Quantization presets and types (for --quant and the recipe's quantization section)."""
    from moetool.quant.plan import PRESET_HELP
    from moetool.quant.types import TYPES

    t = Table(title="quantization presets")
    t.add_column("preset")
    t.add_column("what")
    for name, text in PRESET_HELP.items():
        t.add_row(name, text)
    out.print(t)
    t = Table(title="types (each is also a uniform preset; routers stay f32)")
    for col in ("type", "bits", "bits/weight stored", "block", "written by"):
        t.add_column(col)
    for ty in TYPES.values():
        t.add_row(ty.name, str(ty.bits), f"{ty.bpw:.4g}", str(ty.block), "gguf-py" if ty.python else "llama.cpp")
    out.print(t)


from moetool.package.cli import package_cmd, push_cmd  # noqa: E402

app.command("package")(package_cmd)
app.command("push")(push_cmd)
from moetool.commands.embedding import embedding_app  # noqa: E402

app.add_typer(embedding_app, name="embedding")
from moetool.commands.comigs import comigs_app  # noqa: E402

app.add_typer(comigs_app, name="comigs")
from moetool.commands.gem import gem_app  # noqa: E402

app.add_typer(gem_app, name="gem")
from moetool.commands.hybrid import hybrid_app, profile_cmd  # noqa: E402

app.command("profile")(profile_cmd)
app.add_typer(hybrid_app, name="hybrid")


@app.command()
@_friendly
def build(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Run directory (merged/, tuned/, exports/, hf-repo/).")
    ],
    train: Annotated[
        bool | None,
        typer.Option("--train/--no-train", help="Tune routers (default: when the recipe has a train: section)."),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Held-out tokens per domain in the evaluation.")] = 8192,
    force: Annotated[bool, typer.Option("--force", help="Replace existing outputs.")] = False,
) -> None:
    """The recipe's whole pipeline: merge → tune (if asked) → evaluate → export every `targets:` entry → package."""
    import yaml

    from moetool.api import plan_export
    from moetool.io.atomic import check_output
    from moetool.package import build_repo
    from moetool.recipe import load_recipe

    r: Any = load_recipe(recipe)
    if r.method != "mofe":
        raise MoetoolError(
            f"{recipe}: moetool build runs the mofe pipeline; for method: {r.method} run `moetool merge {recipe} -o DIR`"
            f" and then `moetool {r.method} --help` for its training, evaluation and export commands "
            f"(docs/{r.method}.md)"
        )
    do_train = ("train" in (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {})) if train is None else train
    check_output(output, force=force)
    merged = output / "merged"
    console.rule("merge")
    merge(recipe, output=merged, dry_run=False, force=force, allow_pickle=False)
    model = merged
    if do_train:
        from moetool.train.router_tuning import train_router

        console.rule("router tuning")
        model = output / "tuned"
        train_router(recipe, merged, model, force=force, resume=False, console=console)
    domains = [d for d, src in r.train.data.items() if src.zoo]
    report = None
    if domains:
        console.rule("evaluation")
        names = [str(merged)] + ([str(model)] if model != merged else [])
        report = eval_cmd(
            names,
            domains=",".join(domains),
            data=None,
            own=None,
            seq_len=256,
            max_tokens=max_tokens,
            json_file=output / "eval.json",
            plots=output / "plots",
        )
    else:
        console.print("[yellow]no zoo domains in train.data: evaluation skipped (use moetool eval --data)[/]")
    artifacts = []
    for t in r.targets:
        console.rule(f"export {t.dir_name}")
        exporter, req, plan = plan_export(
            model,
            output / "exports" / t.dir_name,
            target=t.target,
            quant=t.quant,
            device=t.device,
            context=t.context,
            force=force,
        )
        print_quant_plan(plan, f"{exporter.name} plan '{plan.quant.label}' for {plan.name}")
        with console.status(f"writing and verifying {exporter.name} …"):
            manifest = exporter.export(req, plan, console=console)
        out.print(f"[green]wrote[/] {req.output / manifest['file']} ({_human(manifest['artifact']['bytes'])})")
        _print_parity(manifest["parity"])
        artifacts.append(req.output)
    console.rule("Hugging Face repo folder")
    repo = build_repo(
        model,
        output / "hf-repo",
        artifacts=artifacts,
        eval_json=output / "eval.json" if report else None,
        plots=output / "plots" if report else None,
        force=True,
    )
    out.print(f"[green]wrote[/] {repo}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
