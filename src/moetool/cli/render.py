"""Tables and labelled lines for the CLI's results: merge plans, quantization plans, parity, evaluation reports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from moetool.cli.console import human, out

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

    from moetool.api.ask import AskedQuestion
    from moetool.edit.plan import EditPlan
    from moetool.export.base import ArtifactPlan
    from moetool.io.jsontypes import JsonValue
    from moetool.methods.mofe.plan import MergePlan

if TYPE_CHECKING:  # the CLI imports this module at start-up; the export package is imported when used
    from moetool.export.base import Manifest
    from moetool.export.gate import GateReport
    from moetool.export.parity import ParityRecord
    from moetool.io.budget import Need


def print_plan(plan: MergePlan) -> None:
    by_kind = plan.bytes_by_kind()
    t = Table(title=f"merge plan: {plan.recipe.name} → {plan.arch.name} ({plan.dtype})")
    for col in ("tensor", "kind", "source", "shape"):
        t.add_column(col)
    shown = [op for op in plan.ops if ".layers." not in op.out or ".layers.0." in op.out]
    for op in shown:
        t.add_row(op.out, op.kind, op.origin or "(computed)", "×".join(map(str, op.shape)))
    out.print(t)
    layers = plan.config["num_hidden_layers"]
    if layers > 1:
        out.print(f"(layers 1–{layers - 1} repeat layer 0's pattern)")
    s = Table(title="bytes by kind")
    s.add_column("kind")
    s.add_column("bytes", justify="right")
    for k, v in by_kind.items():
        s.add_row(k, human(v))
    s.add_row("[bold]total[/]", f"[bold]{human(plan.total_bytes)}[/] in {len(plan.ops)} tensors")
    out.print(s)
    hidden = plan.recipe.gate_mode == "hidden"
    out.print(
        f"peak memory estimate: {human(plan.peak_memory_estimate())}"
        + (" (the base model loaded once for hidden gates, freed before tensors stream)" if hidden else "")
    )
    for w in plan.warnings:
        out.print(f"[yellow]warning:[/] {w}")


def print_report(report: dict[str, Any]) -> None:
    from moetool.eval.perplexity import render_matrix

    matrix = {m: dict(row) | {"mean": sum(row.values()) / len(row)} for m, row in report["perplexity"].items()}
    ran = sorted(
        {f"{v['dtype']}{_arithmetic(v)} on {v['device']}" for v in report.get("models", {}).values() if "dtype" in v}
    )
    out.print(render_matrix(matrix, "held-out perplexity (lower is better)" + (f"; {', '.join(ran)}" if ran else "")))
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
    if report.get("tasks"):
        print_tasks(report)
    for model, why in report.get("task_failures", {}).items():
        out.print(f"[yellow]task accuracy not measured for {model}:[/] {why}", highlight=False)


def print_tasks(report: dict[str, Any]) -> None:
    """Task accuracy per model (lm-evaluation-harness): ``acc ± stderr``, ``acc_norm`` where the task has it."""
    settings = report["settings"].get("tasks", {})
    names = settings.get("names") or sorted({t for row in report["tasks"].values() for t in row})
    shots, limit = settings.get("num_fewshot"), settings.get("limit")
    t = Table(
        title=f"task accuracy (lm-eval; {shots or 0}-shot" + (f", first {limit} documents" if limit else "") + ")"
    )
    t.add_column("model")
    for n in names:
        t.add_column(n, justify="right")
    for m, row in report["tasks"].items():
        t.add_row(m, *[_score(row.get(n, {})) for n in names])
    out.print(t)


def _score(s: dict[str, float]) -> str:
    key = next((k for k in ("acc", "exact_match", "f1", "mcc") if k in s), None)
    if key is None:
        return "–"
    text = f"{s[key]:.3f} ± {s.get(key + '_stderr', float('nan')):.3f}"
    return text + (f" (norm {s['acc_norm']:.3f})" if key == "acc" and "acc_norm" in s else "")


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


def print_quant_plan(plan: ArtifactPlan, title: str) -> None:
    """Bytes per role and the total: printed before anything is written."""
    q = plan.quant
    t = Table(title=title)
    for col in ("role", "parameters", "types", "bytes"):
        t.add_column(col, justify="right" if col in ("parameters", "bytes") else "left")
    for role, row in q.by_role().items():
        types = ", ".join(f"{ty}×{n}" for ty, n in row["types"].items())
        t.add_row(role, f"{row['params']:,}", types, human(row["bytes"]))
    t.add_row("[bold]total[/]", f"{q.total_params:,}", f"{q.bpw():.2f} bits/weight", f"[bold]{human(q.total_bytes)}[/]")
    out.print(t)
    for note in q.notes():
        out.print(f"[yellow]note[/]: {escape(note)}")
    if plan.memory is not None:
        m = plan.memory
        line = (
            f"memory at {plan.context} tokens: weights {human(m.weights)} + KV cache {human(m.kv_cache)} + "
            f"runtime {human(m.runtime)} = {human(m.total)}"
        )
        if plan.device:
            from moetool.quant.devices import get_device

            line += f" (budget on {plan.device}: {human(get_device(plan.device).budget)})"
        out.print(line)
    options = {k: v for k, v in getattr(plan, "options", {}).items() if v is not None}
    if options:
        out.print("target options: " + ", ".join(f"{k} {v}" for k, v in options.items()), highlight=False)
    for label, total, fits in getattr(plan, "candidates", []):
        mark = "[green]fits[/]" if fits else "[red]too big or unsupported[/]"
        out.print(f"  plan {label}: {human(total)} {mark}{'  ← chosen' if label == q.label else ''}")


def print_parity(p: ParityRecord | str | None) -> None:
    """A manifest's parity record: what was compared, the verdict with its tolerance or gate, the figures, and the
    margin gate's figures where there is one; or why it was not verified."""
    from moetool.export.parity import ParityRecord
    from moetool.export.parity_text import describe, figures, verdict_text

    if not isinstance(p, ParityRecord):
        out.print(f"[yellow]{escape(verdict_text(p))}[/]")
        return
    colour = {"pass": "green", "fail": "red"}.get(p.outcome, "yellow")
    if p.bundle is not None:
        out.print(f"parity: [{colour}]{escape(describe(p))}[/]", highlight=False)
        return
    what = " vs ".join(x for x in (p.runtime, p.reference) if x)
    text = f", {p.text} text" if p.text else ""
    out.print(
        f"parity ({escape(what or 'figures')}{escape(text)}): [{colour}]{escape(verdict_text(p))}[/]: "
        + escape("; ".join(figures(p, gate=False)) or "no figures"),
        highlight=False,
    )
    if p.gate is not None:
        print_gate(p.gate)


def print_gate(g: GateReport) -> None:
    """The margin gate's verdict and figures (a GGUF's ``parity.gate``), beside the old gate's raw top-1."""
    from moetool.export.parity_text import gate_text

    colour = "green" if g.passed else "red"
    out.print(f"[{colour}]{escape(gate_text(g))}[/]", highlight=False)
    for problem in g.problems:
        out.print(f"[red]gate[/]: {escape(problem)}", highlight=False)


def print_description(text: str) -> None:
    """A method's ``--dry-run`` description, line by line (labelled lines, never wrapped)."""
    for line in text.splitlines():
        out.print(escape(line), highlight=False)


def print_export_plan(exporter: Any, plan: Any, title: str) -> None:
    """The quantization plan of a standard exporter, or what a method's own exporter will write."""
    if hasattr(plan, "quant"):
        print_quant_plan(plan, title)
    else:
        out.print(f"{exporter.name} plan for {plan.name}: {plan.description}", highlight=False)


def print_export_need(need: Need | None) -> None:
    """What the export would need of this machine (``--dry-run``), and whether it fits."""
    from moetool.errors import MoetoolError

    if need is None:
        return
    out.print(
        f"the export needs about {human(need.memory)} of memory ({need.memory_detail})"
        + (f" and writes about {human(need.disk)}" if need.disk else ""),
        highlight=False,
    )
    try:
        need.check()
    except MoetoolError as exc:
        out.print(f"[red]it would be refused:[/] {escape(str(exc))}")


def print_output_check(output: Path, force: bool) -> None:
    """``--dry-run``: whether the real run would be refused because ``output`` exists (and what allows it), or that
    it replaces it (``--force``). Reads the folder only: a dry run writes (and sweeps) nothing."""
    from moetool.io.atomic import occupied

    if not occupied(output):
        return
    if force:
        out.print(f"--force: the real run replaces {escape(str(output))}", highlight=False)
        return
    out.print(
        f"[red]the real run would be refused:[/] {escape(str(output))} exists and is not empty; pass --force to "
        "replace it, or write to another -o",
        highlight=False,
        soft_wrap=True,
    )


def print_manifest(output: Path | str, manifest: Manifest) -> None:
    """What an export wrote and its parity figures (standard exporters and methods' own alike)."""
    from pathlib import Path

    where = Path(output) / manifest.file if manifest.file else Path(output)
    size = manifest.artifact_bytes
    pieces = manifest.get("chunks") or manifest.get("programs")  # Core ML, ExecuTorch converted in chunks
    if isinstance(pieces, list) and len(pieces) > 1 and manifest.get("join"):  # Core ML: one package joined from them
        size_text = f" (one package joined from {len(pieces)} chunks{', ' + human(size) if size else ''})"
    elif isinstance(pieces, list) and len(pieces) > 1:
        where = Path(output)
        size_text = f" ({len(pieces)} chunks run in sequence, {human(size)})" if size else ""
    else:
        size_text = f" ({human(size)})" if size else ""
    out.print(f"[green]wrote[/] {where}{size_text}")
    origin = manifest.origin
    if origin is not None:
        key, source, parity = origin
        from moetool.export.parity_text import describe

        out.print(f"{key}: {escape(source)}: {escape(describe(parity))}", highlight=False)
    if manifest.parity is not None:
        print_parity(manifest.parity)
    gen = manifest.part("generation")
    if gen:
        verdict = (
            "equal to transformers' (float32)"
            if gen["tokens_equal"]
            else f"first difference from transformers' (float32) at token {gen['first_difference']}"
        )
        out.print(f"generation in {gen['runner']}: {gen['new_tokens']} greedy tokens, {verdict}", highlight=False)
    for part in ("router", "pathways", "experts"):
        if part in manifest:
            out.print(f"{part}: {_summary(manifest[part])}", highlight=False)
    im = manifest.part("imatrix")
    if im:
        experts = im.get("expert_tokens")
        counts = [v for v in experts.values() if isinstance(v, dict)] if isinstance(experts, dict) else []
        used = [min(_ints(v.get("used"))) for v in counts if _ints(v.get("used"))]
        routed = [min(_ints(v.get("routed"))) for v in counts if _ints(v.get("routed"))]
        forced = im.get("forced")
        n_forced = sum(len(_ints(v)) for v in forced.values()) if isinstance(forced, dict) else 0
        tokens = im.get("tokens")
        line = f"imatrix: {im.get('file')} ({im.get('mode')}, {sum(_ints(tokens) if isinstance(tokens, dict) else [])} tokens"
        line += f"; fewest tokens of an expert: routed {min(routed)}" if routed else ""
        line += f", used {min(used)}" if used else ""
        line += f"; {n_forced} expert(s) below the floor computed on every token" if n_forced else ""
        out.print(line + ")", highlight=False)


def _ints(value: JsonValue) -> list[int]:
    """The integers of a JSON array (or an object's values)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [v for v in items if isinstance(v, int)]


def _summary(value: JsonValue) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items() if not isinstance(v, dict | list))
    if isinstance(value, list):
        return (
            f"{len(value)} ({', '.join(str(v.get('name', v.get('dir', '?'))) for v in value if isinstance(v, dict))})"
        )
    return str(value)


def _one_line(text: str, limit: int = 160) -> str:
    """An answer on one line (whitespace runs collapsed), cut at ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def print_answers(answers: list[AskedQuestion]) -> None:
    """The closing table: each question, the MoE's answer in transformers with the expert shares behind it, and
    each GGUF's answer in llama.cpp (answers on one line; answers.json has them whole)."""
    t = Table(title="one question per domain, greedy answers through the chat template (answers.json has them whole)")
    for col in ("domain", "runtime", "answer", "experts (share of routing choices)"):
        t.add_column(col, overflow="fold")
    for q in answers:
        a = q.answer
        shares = ", ".join(f"{n} {v:.0%}" for n, v in sorted(a.shares.items(), key=lambda kv: -kv[1]))
        t.add_row(f"[bold]{escape(a.label)}[/]", "question", escape(a.question), "")
        t.add_row("", "transformers", escape(_one_line(a.text)), shares)
        for name, g in q.gguf.items():
            same = "same tokens" if g.matches else f"first {g.same_prefix} tokens the same"
            t.add_row("", f"llama.cpp ({escape(name)})", escape(_one_line(g.text)) + f" [dim]({same})[/]", "")
    out.print(t)


def experts_table(console: Console, report: dict[str, Any]) -> None:
    """``moetool experts list``: one row per expert; with routing figures, its share and REAP saliency per layer."""
    routing: dict[str, Any] = report.get("routing") or {"layers": {}, "domains": {}}
    table = Table(
        title=f"{report['path']}: {report['architecture']}, {len(report['experts'])} experts, top-{report['top_k']}, "
        f"width {report['width']}, {report['dtype']}" + (", shared expert" if report["shared_expert"] else "")
    )
    table.add_column("index", justify="right")
    table.add_column("name")
    layers = list(routing["layers"])
    for layer in layers:
        table.add_column(f"L{layer} share / REAP", justify="right")
    for d in routing["domains"]:
        table.add_column(f"share on {escape(d)}", justify="right")
    for i, name in enumerate(report["experts"]):
        cells = [str(i), escape(name)]
        for layer in layers:
            figures = routing["layers"][layer]
            cells.append(f"{figures['share'][i]:.3f} / {figures['reap'][i]:.3g}")
        for d in routing["domains"]:
            cells.append(f"{routing['domains'][d]['share'][i]:.3f}")
        table.add_row(*cells)
    console.print(table)
    for edit in report["edits"]:
        console.print(f"edit: {escape(str(edit))}", highlight=False)


def print_edit_plan(console: Console, plan: EditPlan) -> None:
    """``moetool experts … --dry-run``: what the edit would write, read from its plan (no weights)."""
    from moetool.io.checkpoint import SAFETENSORS_TAG_BYTES

    total = sum(op.numel * SAFETENSORS_TAG_BYTES[op.dtype] for op in plan.ops)
    console.print(f"{plan.record['summary']} (dry run: nothing written)", highlight=False)
    if plan.names:
        console.print(f"  experts: {', '.join(plan.names)}; top-{plan.config.get('num_experts_per_tok')}")
    console.print(f"  {len(plan.ops)} tensors, {human(total)}; every tensor streamed one at a time", highlight=False)
    for note in plan.warnings:
        console.print(f"  [yellow]warning:[/] {escape(note)}")


def _arithmetic(model: dict[str, Any]) -> str:
    """`` (float32 arithmetic)`` where a model computed in another dtype than it is held in, else nothing."""
    how = model.get("arithmetic", model["dtype"])
    return "" if how == model["dtype"] else f" ({how} arithmetic)"
