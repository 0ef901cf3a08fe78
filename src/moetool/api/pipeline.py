"""``build``: every stage of a recipe in order, the CLI's ``moetool build`` and ``moetool demo``."""

from __future__ import annotations

import importlib.util
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from moetool.api.ask import AskedQuestion, ask
from moetool.api.stages import (
    RecipeLike,
    assemble,
    evaluate,
    load,
    package,
    plan_export,
    plugin,
    train,
    write_report,
)
from moetool.errors import MoetoolError
from moetool.export.base import Manifest
from moetool.io.atomic import check_output
from moetool.io.files import is_bundle
from moetool.methods.base import MethodPlugin, Stage
from moetool.progress import silent
from moetool.recipe.base import RecipeBase
from moetool.recipe.export import TargetSpec
from moetool.recipe.mofe import MoFERecipe


@dataclass
class BuildResult:
    """What :func:`build` wrote: the merged and tuned models, the evaluation, each artifact's manifest, the repo."""

    merged: Path
    model: Path
    tuned: dict[str, Path] = field(default_factory=dict)
    report: dict[str, Any] | None = None
    manifests: dict[str, Manifest] = field(default_factory=dict)
    repo: Path | None = None
    answers: list[AskedQuestion] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # optional steps that failed (the rest of the build went on)


def build(
    recipe: RecipeLike,
    output: str | Path,
    *,
    tune: bool | None = None,
    presets: list[str] | None = None,
    compare: list[str] | None = None,
    profiles: list[str] | None = None,
    max_tokens: int | None = None,
    tasks: list[str] | None = None,
    task_limit: int | None = None,
    force: bool = False,
    verify: bool = True,
    console: Console | None = None,
    on_stage: Stage | None = None,
    devices: list[str] | None = None,
) -> BuildResult:
    """Run the recipe's whole pipeline: assemble → tune → evaluate → export → package.

    Tuning runs when ``tune`` says (default: when the recipe has ``train:``), once per preset; evaluation covers the
    merged and tuned models beside ``compare`` on ``max_tokens`` held-out tokens per domain (default 8192; lm-eval
    ``tasks`` too, ``task_limit`` documents each, optional: a failure is recorded in ``BuildResult.failed`` and the
    build goes on); every ``targets:`` entry (or only those ``for:`` one of
    ``profiles``, deployment profiles; ``devices`` is its old keyword) is exported; the recipe's ``questions:`` are asked of the final model and of each GGUF written
    (``answers.json``). ``on_stage(name, result_so_far)`` is called after each stage (the CLI prints its figures).

    Another method runs the stages it has (:func:`build_method`).

    Raises:
        MoetoolError: a stage asked for that the recipe's method does not have, or a ``targets:`` entry it cannot
            write, named before any work.
        OutputExistsError: ``output`` exists and ``force`` is not given.
    """
    profiles = _profiles(profiles, devices)
    r = load(recipe)
    out, console = Path(output), console or silent()
    stage: Stage = on_stage or (lambda name, value: None)
    if not isinstance(r, MoFERecipe):
        # evaluation's options by their CLI names: another method's build has no evaluation stage to read them
        asked = {"presets": presets, "compare": compare, "tasks": tasks, "max-tokens": max_tokens,
                 "task-limit": task_limit}  # fmt: skip
        return build_method(r, out, tune=tune, profiles=profiles, asked=asked, force=force, verify=verify,
                            console=console, stage=stage)  # fmt: skip
    check_output(out, force=force)
    console.rule("merge")
    merged = assemble(r, out / "merged", force=force, console=console)
    result = BuildResult(merged=merged, model=merged)
    stage("merged", merged)
    if tune if tune is not None else "train" in r.model_fields_set:
        for preset in [*presets] if presets else [None]:
            console.rule(f"router tuning{f', freeze preset {preset}' if preset else ''}")
            path = out / (f"tuned-{preset}" if presets else "tuned")
            outcome = train(r, path, model=merged, force=force, resume=False, preset=preset, console=console)
            result.tuned[preset or "tuned"] = result.model = outcome.output
            stage("trained", (preset, outcome))
    tasks_ = (tasks, task_limit)
    result.report = _build_eval(r, out, result, compare or [], max_tokens or 8192, tasks_, console, stage)
    _build_exports(r, out, result, profiles, force=force, verify=verify, console=console, stage=stage)
    _build_answers(r, out, result, console, stage)
    console.rule("Hugging Face repo folder")
    has_report = result.report is not None
    result.repo = package(
        result.model,
        out / "hf-repo",
        artifacts=[out / "exports" / n for n in result.manifests],
        eval_json=out / "eval.json" if has_report else None,
        plots=out / "plots" if has_report else None,
        force=True,
    )
    stage("packaged", result.repo)
    return result


def _profiles(profiles: list[str] | None, devices: list[str] | None) -> list[str] | None:
    """``profiles``, or ``devices``, its old keyword, with a DeprecationWarning.

    Raises:
        MoetoolError: both keywords given.
    """
    if devices is None:
        return profiles
    if profiles is not None:
        raise MoetoolError("devices= is the old keyword of profiles= (deployment profiles), which is also given")
    warnings.warn(
        "build(devices=...) is the old keyword: write profiles=... (deployment profiles, as `for:` and "
        "`moetool export --for`; read in this release, not in the next)",
        DeprecationWarning,
        stacklevel=3,
    )
    return devices


def has_stage(p: MethodPlugin[Any, Any], name: str) -> bool:
    """Whether method plugin ``p`` implements stage ``name`` (``train``) rather than inheriting the refusal."""
    return getattr(type(p), name) is not getattr(MethodPlugin, name)


def build_method(
    r: RecipeBase,
    out: Path,
    *,
    tune: bool | None,
    profiles: list[str] | None,
    asked: dict[str, Any],
    force: bool,
    verify: bool,
    console: Console,
    stage: Stage,
) -> BuildResult:
    """The pipeline of a method other than mofe, in the stages it has.

    merge → train (when the method trains after the merge) → the recipe's ``targets:`` (when it has them) → a Hugging
    Face repo folder (when the final output is one model folder or a bundle).

    Raises:
        MoetoolError: a stage or option the method does not have (``tune``, ``profiles``, evaluation's ``compare``,
            ``tasks``, ``max-tokens`` and ``task-limit``, mofe's freeze ``presets``), named before any work.
        RecipeError: a ``targets:`` entry the method's output cannot be exported as (a target it cannot write, a key
            its exporter would not read), named before any work.
    """
    p = plugin(r)
    targets = list(getattr(r, "targets", None) or [])
    missing = [f"--{k}" for k, v in asked.items() if v is not None and v != []]
    if tune and not has_stage(p, "train"):
        missing.append("--train (its models train inside `moetool merge`)")
    if profiles is not None:
        missing.append("profiles (its targets: name targets, not deployment profiles)")
    if missing:
        raise MoetoolError(
            f"{r.path or r.name}: method {r.method} has no stage for {', '.join(missing)}; `moetool build` runs its "
            f"merge{', training' if has_stage(p, 'train') else ''}{', targets' if targets else ''} and packaging"
        )
    p.check_targets(r)  # a target the method cannot write is a plan-time fact: refused before the merge
    check_output(out, force=force)
    console.rule(f"merge ({r.method})")
    merged = assemble(r, out / "merged", force=force, console=console)
    result = BuildResult(merged=merged, model=merged)
    stage("merged", merged)
    if has_stage(p, "train") and tune is not False:
        console.rule(f"training ({r.method})")
        outcome = train(r, out / "tuned", model=merged, force=force, resume=False, console=console)
        result.tuned["tuned"] = result.model = outcome.output
        stage("trained", (None, outcome))
    for t in targets:
        _export_one(r, t, out, result, force=force, verify=verify, console=console, stage=stage)
    if (result.model / "config.json").is_file() or is_bundle(result.model):
        console.rule("Hugging Face repo folder")
        exports = [out / "exports" / n for n in result.manifests]
        result.repo = package(result.model, out / "hf-repo", artifacts=exports, force=True)
        stage("packaged", result.repo)
    else:
        console.print(
            f"[yellow]{result.model.name} is neither one model folder nor a bundle: no Hugging Face repo folder "
            "written[/]"
        )
    return result


def _build_exports(
    r: MoFERecipe,
    out: Path,
    result: BuildResult,
    profiles: list[str] | None,
    *,
    force: bool,
    verify: bool,
    console: Console,
    stage: Stage,
) -> None:
    """Export every ``targets:`` entry of the recipe (or only those for ``profiles``) into ``out/exports``."""
    for t in r.targets:
        if profiles is None or t.for_ in profiles:
            _export_one(r, t, out, result, force=force, verify=verify, console=console, stage=stage)


def _export_one(
    r: RecipeBase,
    t: TargetSpec,
    out: Path,
    result: BuildResult,
    *,
    force: bool,
    verify: bool,
    console: Console,
    stage: Stage,
) -> None:
    """One ``targets:`` entry of the final model into ``out/exports/<its name>``.

    Planned from recipe ``r`` itself (its quantization section and training data, as objects): nothing is read
    back from the model's folder.
    """
    console.rule(f"export {t.dir_name}")
    job = plan_export(
        result.model,
        out / "exports" / t.dir_name,
        target=t.target,
        quant=t.quant,
        for_=t.for_,
        context=t.context,
        force=force,
        verify=verify,
        imatrix=t.imatrix,
        recipe=r,
    )
    stage("export_plan", (t.dir_name, job.exporter, job.plan))
    with console.status(f"writing and verifying {job.exporter.name} …"):
        result.manifests[t.dir_name] = job.run(console)
    stage("exported", (job.request.output, result.manifests[t.dir_name]))


def _build_eval(
    r: MoFERecipe,
    out: Path,
    result: BuildResult,
    compare: list[str],
    max_tokens: int,
    tasks: tuple[list[str] | None, int | None],
    console: Console,
    stage: Stage,
) -> dict[str, Any] | None:
    """Evaluate the merged and tuned models (beside ``compare``) on the recipe's zoo domains, if it has any."""
    domains = [d for d, src in r.train.data.items() if src.zoo]
    if not domains:
        console.print("[yellow]no zoo domains in train.data: evaluation skipped (use moetool eval --data)[/]")
        return None
    console.rule("evaluation")
    names = [*compare, str(result.merged), *[str(p) for p in result.tuned.values()]]
    names_, limit = tasks
    report = evaluate(
        names, domains=domains, max_tokens=max_tokens, tasks=names_, limit=limit,
        on_model=lambda m: console.print(f"lm-eval tasks: {m} …"), optional_tasks=True,
    )  # fmt: skip
    for model, why in report.get("task_failures", {}).items():
        # task accuracy is optional: the verdict, the export and the answers do not depend on it
        result.failed.append(f"task accuracy of {model}: {why}")
        console.print(f"[yellow]task accuracy failed for {model} (the build goes on):[/] {why}")
    write_report(report, out / "eval.json", out / "plots")
    stage("evaluated", report)
    return report


def _build_answers(r: MoFERecipe, out: Path, result: BuildResult, console: Console, stage: Stage) -> None:
    """Ask the recipe's questions (if any) of the final model and of every GGUF exported; writes ``answers.json``."""
    if not r.questions:
        return
    console.rule("questions")
    ggufs = {
        name: out / "exports" / name / m.file for name, m in result.manifests.items() if m.target == "gguf" and m.file
    }
    if ggufs and importlib.util.find_spec("llama_cpp") is None:
        console.print("[yellow]llama-cpp-python is not installed: questions are answered by transformers only[/]")
        ggufs = {}
    with console.status("answering the recipe's questions …"):
        result.answers = ask(result.model, dict(r.questions), ggufs=ggufs)
    doc = {"model": str(result.model), "answers": [a.to_json() for a in result.answers]}
    (out / "answers.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    stage("answered", result.answers)
