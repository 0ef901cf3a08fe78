"""The pipeline's stages, one function each (:mod:`moetool.api` re-exports them)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

from rich.console import Console

from moetool.errors import MoetoolError
from moetool.eval.report import evaluate as run
from moetool.eval.residency import eval_residency
from moetool.export.base import ExportError, ExportJob, ExportRequest, Manifest, check_artifact_dir
from moetool.export.gguf.lora import export_adapter, is_adapter
from moetool.export.resolve import ExportOptions, check_method_options, plan_standard_export
from moetool.io.atomic import atomic_write_text
from moetool.io.checks import check_finished_model_dir, check_output_path, check_report_path, is_moetool_temp
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.io.safe import read_json, read_text
from moetool.io.sources import resolve_source
from moetool.methods import get_plugin, plugin_for_model
from moetool.methods.base import MethodPlan, MethodPlugin, TrainOptions, TrainOutcome
from moetool.package import build_repo
from moetool.progress import silent
from moetool.quant.plan import QuantSpec
from moetool.recipe.base import RecipeBase
from moetool.recipe.inputs import recipe_inputs
from moetool.recipe.load import load_recipe
from moetool.zoo import split_zoo_name, zoo_domain_text

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from moetool.methods.mofe.plan import MergePlan

RecipeLike = RecipeBase | str | Path


def load(recipe: RecipeLike) -> RecipeBase:
    """The validated recipe: a path is read and validated once; a recipe object is returned as it is."""
    return recipe if isinstance(recipe, RecipeBase) else load_recipe(recipe)


def plugin(recipe: RecipeBase) -> MethodPlugin:
    """The recipe's method plugin (:data:`moetool.registry.METHODS`)."""
    return get_plugin(recipe.method)


def check(recipe: RecipeLike) -> list[str]:
    """Check everything knowable without weights (``moetool validate``); returns warnings.

    The recipe's own validation, its ``targets:`` against what the method's output exports to, then the method's
    checks against what it names (mofe: every prompt through the base's tokenizer).

    Raises:
        MoetoolError: naming the recipe file and the field.
    """
    r = load(recipe)
    p = plugin(r)
    p.check_targets(r)
    return p.check(r)


def plan(recipe: RecipeLike, *, allow_pickle: bool = False) -> MergePlan | MethodPlan:
    """What ``assemble`` would build, from configs and headers only; nothing is written.

    A :class:`~moetool.methods.mofe.MergePlan` for mofe (every output tensor), a
    :class:`~moetool.methods.base.MethodPlan` for the other methods (their inputs, parameter counts, description).
    """
    r = load(recipe)
    described: MergePlan | MethodPlan = plugin(r).describe(r, allow_pickle=allow_pickle)
    return described


def assemble(
    recipe: RecipeLike,
    output: str | Path,
    *,
    force: bool = False,
    allow_pickle: bool = False,
    console: Console | None = None,
    device: str | None = None,
) -> Path:
    """Build the recipe's model into ``output`` (atomically; an existing output only with ``force``).

    ``device``: where a mofe merge runs the base for hidden-state routers (auto: a GPU when there is one).
    """
    r = load(recipe)
    check_output_path(output, recipe_inputs(r))  # before any work: never into, over or around an input
    return Path(
        plugin(r).assemble(
            r, Path(output), force=force, allow_pickle=allow_pickle, console=console or silent(), device=device
        )
    )


def train(
    recipe: RecipeLike,
    output: str | Path,
    *,
    model: str | Path | None = None,
    force: bool = False,
    resume: bool = True,
    preset: str | None = None,
    console: Console | None = None,
    **options: object,
) -> TrainOutcome:
    """The method's training (mofe: router tuning of the merged ``model``, resumable; comigs: the federation)."""
    r = load(recipe)
    check_output_path(output, [*recipe_inputs(r), *([Path(model)] if model is not None else [])])
    opts = TrainOptions(force=force, resume=resume, preset=preset, extra=options)
    return plugin(r).train(r, Path(model) if model is not None else None, Path(output), opts, console or silent())


def evaluate(
    models: list[str],
    *,
    domains: list[str] | None = None,
    data: dict[str, Path] | None = None,
    own: dict[str, str] | None = None,
    seq_len: int = 256,
    max_tokens: int = 32768,
    tasks: list[str] | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    on_model: Callable[[str], None] | None = None,
    optional_tasks: bool = False,
    dtype: str = "auto",
    device: str = "auto",
) -> dict[str, Any]:
    """Evaluate every model (dirs or ``zoo:NAME``) side by side.

    Per-domain held-out perplexity, routing statistics and GEM metrics, and lm-evaluation-harness ``tasks`` when
    asked for.
    ``domains`` default to the names in ``data`` when it has any, else the zoo's (code, legal, medical).
    Held-out text per domain comes from ``data`` (DOMAIN → file) or the zoo; a model's own domain (for GG/DSI) from
    ``own``, else its zoo name or directory name. ``tasks`` are lm-eval task names, ``local`` (a continuation task
    per evaluated domain with enough held-out text, :mod:`moetool.eval.tasks`) or ``moetool_cont_DOMAIN``; ``limit`` documents per task,
    ``num_fewshot`` examples in each prompt. Task scores go under ``tasks[model][task]``. A local task's file that
    vanished from the cache since the start is rebuilt before each model is scored. With ``optional_tasks``, a
    model whose tasks fail is recorded under ``task_failures[model]`` (the reason) and the evaluation goes on.
    Every model runs in ``dtype`` (``auto``: its checkpoint's own) on ``device`` (``auto``: a GPU when there is one).

    Raises:
        MoetoolError: a ``data`` domain left out of ``domains``, a text too short for its task.
        TaskError: lm-eval could not run the tasks (unless ``optional_tasks``).
    """
    files = data or {}
    domains = eval_domains(domains, files)
    texts = _held_out_texts(domains, files)
    paths = {m: resolve_source(m).path for m in models}
    # before any model is loaded: one that fits neither resident nor streamed from disk is named now
    residency = {m: eval_residency(p, dtype=dtype, seq_len=seq_len) for m, p in paths.items()}
    owners = {m: _own_domain(m, p, domains) for m, p in paths.items()} | (own or {})
    configs = _task_configs(tasks, texts, files) if tasks else []  # a text too short fails before any model runs
    scores: dict[str, dict[str, dict[str, float]]] = {}
    failures: dict[str, str] = {}

    def tasks_of(name: str, model: PreTrainedModel, tok: PreTrainedTokenizerBase) -> None:
        from moetool.eval.harness import TaskError, task_scores

        if on_model is not None:
            on_model(name)
        try:
            # the cache is disposable: a task file removed since the start (another process clearing the cache) is
            # written again, from the same text, under the same name
            now = _task_configs(tasks or [], texts, files)
            scores[name] = task_scores(model, tok, now, limit=limit, num_fewshot=num_fewshot)
        except TaskError as exc:
            if not optional_tasks:
                raise
            failures[name] = str(exc)

    report = run(
        paths,
        texts,
        own_domains=owners,
        seq_len=seq_len,
        max_tokens=max_tokens,
        also=tasks_of if configs else None,
        dtype=dtype,
        device=device,
        residency=residency,
    )
    if failures:
        report["task_failures"] = failures
    if configs:
        report["tasks"] = scores
        report["settings"]["tasks"] = {
            "names": [_task_name(t) for t in configs],
            "limit": limit,
            "num_fewshot": num_fewshot,
        }
    return report


ZOO_DOMAINS = ("code", "legal", "medical")


def _held_out_texts(domains: list[str], files: dict[str, Path]) -> dict[str, str]:
    """Each domain's held-out text: its ``--data`` file (UTF-8, named errors) or the zoo's.

    Raises:
        MoetoolError: a file that cannot be read, is not UTF-8, or has no text.
    """
    texts = {d: _domain_text(d, files) for d in domains}
    empty = [d for d, t in texts.items() if not t.strip()]
    if empty:
        raise MoetoolError(f"--data {empty[0]}={files.get(empty[0], '')}: the file has no text to score")
    return texts


def eval_domains(domains: list[str] | None, data: dict[str, Path]) -> list[str]:
    """The domains to evaluate.

    ``domains`` as given (each file in ``data`` must be one of them), else the names in ``data``, else the zoo's.

    Raises:
        MoetoolError: ``data`` names a domain ``domains`` leaves out (its file would be ignored).
    """
    if domains is None:
        return list(data) or list(ZOO_DOMAINS)
    ignored = [d for d in data if d not in domains]
    if ignored:
        raise MoetoolError(
            f"--data {', '.join(f'{d}={data[d]}' for d in ignored)}: {', '.join(ignored)} is not among --domains "
            f"{','.join(domains)}, so the file would not be read; add it to --domains, or leave --domains out to "
            "evaluate the --data domains"
        )
    return domains


def _task_name(task: str | JsonObject) -> str:
    return task if isinstance(task, str) else str(task["task"])


def _task_configs(tasks: list[str], texts: dict[str, str], files: dict[str, Path]) -> list[str | JsonObject]:
    """lm-eval task names as they are; ``local`` and ``moetool_cont_DOMAIN`` as task configs over held-out text."""
    from moetool.eval.tasks import local_domain, min_words, task_name, write_local_tasks
    from moetool.paths import cache_dir

    wanted: list[str] = []
    for t in tasks:
        # `local`: the domains with enough held-out text (a named moetool_cont_DOMAIN task is built or refused)
        wanted += [task_name(d) for d, x in texts.items() if len(x.split()) >= min_words()] if t == "local" else [t]
    local = {d: texts.get(d) or _domain_text(d, files) for t in wanted if (d := local_domain(t)) is not None}
    configs = write_local_tasks(local, cache_dir() / "lm-eval-tasks")
    return [configs.get(t, t) for t in dict.fromkeys(wanted)]


def _domain_text(domain: str, files: dict[str, Path]) -> str:
    return read_text(files[domain], what=f"--data {domain}") if domain in files else _zoo_text(domain)


def _zoo_text(domain: str) -> str:

    return zoo_domain_text(domain, "valid")


def _own_domain(ref: str, path: Path, domains: list[str]) -> str | None:
    """An expert's own domain: ``zoo:DOMAIN`` or a directory named after a domain."""
    name = split_zoo_name(ref.removeprefix("zoo:"))[1] if ref.startswith("zoo:") else path.name
    return name if name in domains else None


def check_report_outputs(json_file: Path | None, plots: Path | None, inputs: list[Path]) -> None:
    """Refuse, before any evaluation runs, report paths that could not be written or would replace an input.

    Raises:
        OutputPathError: ``json_file`` is a directory, lies under a file or an unwritable folder, or is one of
            ``inputs`` (a ``--data`` file, a model); likewise ``plots``.
    """
    if json_file is not None:
        check_report_path(json_file, inputs, option="--output")  # the CLI writes a report with -o FILE
    if plots is not None:
        check_report_path(plots, inputs, option="--plots", folder=True)


def nonfinite_figures(report: Mapping[str, JsonValue]) -> list[str]:
    """The ``model on domain`` pairs whose perplexity is not a finite number (NaN weights, an overflow)."""
    table = report.get("perplexity")
    bad = []
    for model, row in table.items() if isinstance(table, dict) else ():
        numbers = row.items() if isinstance(row, dict) else ()
        bad += [f"{model} on {domain}" for domain, v in numbers if isinstance(v, float) and not math.isfinite(v)]
    return bad


def write_report(report: Mapping[str, JsonValue], json_file: Path | None, plots: Path | None) -> list[Path]:
    """The evaluation report as JSON and PNG plots; returns the files written."""
    written = []
    if json_file is not None:
        atomic_write_text(json_file, json.dumps(report, indent=2))  # a report replaced whole or not at all
        written.append(json_file)
    if plots is not None:
        from moetool.eval.plots import write_plots

        written += list(write_plots(report, plots))
    return written


def plan_export(model: str | Path, output: str | Path, **opts: Unpack[ExportOptions]) -> ExportJob[Any]:
    """The planned export of ``model`` (exporter, request, plan); nothing is written.

    ``opts``: :class:`~moetool.export.resolve.ExportOptions`. A method's own output gets its method's exporter.
    ``plan_export(...).run(console)`` writes it.

    Raises:
        ExportError: what :func:`~moetool.export.resolve.plan_standard_export` refuses; a deployment profile
            (``for_``, ``--for``) for a method's output.
        OutputPathError: ``output`` names an artifact file or lies inside the model.
    """
    model_dir = resolve_source(str(model)).path
    check_artifact_dir(output)
    check_output_path(output, [model_dir])
    owner = None if is_moetool_temp(model_dir) else plugin_for_model(model_dir)
    if owner is None:  # a standard model: not a killed run's temp dir, not a half-written folder
        check_finished_model_dir(model_dir)
        return plan_standard_export(model_dir, output, **opts)
    check_method_options(model_dir, owner.name, opts)
    exporter = owner.exporter(model_dir, opts.get("target"))
    quant = opts.get("quant")
    req = ExportRequest(
        model_dir=model_dir,
        output=Path(output),
        quant=QuantSpec(preset="f16"),
        verify=opts.get("verify", True),
        force=opts.get("force", False),
        eval_text=opts.get("eval_text"),
        context=opts.get("context"),
        options={**(opts.get("options") or {}), "quant": quant if isinstance(quant, str) else None},
    )
    return ExportJob(exporter, req, exporter.plan(req))


def adapter_base(adapter: Path, base: str | Path | None) -> Path:
    """The base model of a PEFT adapter: ``base`` if given, else its ``base_model_name_or_path`` (resolved locally).

    Raises:
        ExportError: the adapter names no base model and none is given.
    """
    config = Path(adapter) / "adapter_config.json"
    ref = base or read_json(config, what="PEFT adapter config", error=ExportError).get("base_model_name_or_path")
    if not isinstance(ref, str | Path) or not str(ref):
        raise ExportError(f"{adapter}: the adapter names no base model; pass --base")
    return resolve_source(str(ref), relative_to=Path(adapter)).path


def export(
    model: str | Path,
    output: str | Path,
    *,
    console: Console | None = None,
    base: str | Path | None = None,
    **kw: Unpack[ExportOptions],
) -> Manifest:
    """Plan, write, verify and describe one artifact; returns its manifest (also written next to it).

    ``kw``: :class:`~moetool.export.resolve.ExportOptions` (target options and a method's ``options`` included: they
    are part of the plan). A PEFT adapter directory as ``model`` becomes a GGUF LoRA adapter for ``base``.
    """
    if is_adapter(Path(model)):
        check_artifact_dir(output)
        doc = export_adapter(
            Path(model),
            adapter_base(Path(model), base),
            Path(output),
            force=kw.get("force", False),
            verify=kw.get("verify", True),
            eval_text=kw.get("eval_text"),
            out_type=str(kw.get("quant") or "f32"),
        )
        return Manifest.of(doc, source="the GGUF LoRA exporter")
    return plan_export(model, output, **kw).run(console or silent())


def package(
    source: str | Path,
    output: str | Path,
    *,
    artifacts: list[Path] | None = None,
    eval_json: Path | None = None,
    plots: Path | None = None,
    force: bool = False,
) -> Path:
    """A Hugging Face repo folder: weights, tokenizer, provenance, artifacts, evaluation, model card."""
    return Path(
        build_repo(Path(source), Path(output), artifacts=artifacts or [], eval_json=eval_json, plots=plots, force=force)
    )
