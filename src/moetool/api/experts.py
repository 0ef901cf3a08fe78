"""Edit an MoE after it is built (``moetool experts``): list, add, remove, prune and extract experts.

Each works on moetool's outputs and on third-party folders of every output architecture (Mixtral, Qwen2-MoE with or
without a shared expert, Qwen3-MoE, GraniteMoE); expert names come from ``moetool.json`` where moetool built the MoE,
indices work everywhere. Every edit streams one tensor at a time into a temporary folder, checks itself against its
input there (:mod:`moetool.edit.parity`) and only then moves into place; ``tune`` recalibrates the routers after.

    api.experts.remove(moe, ["medical"], "out/two")
    api.experts.prune(moe, "out/pruned", keep=2, by="reap", data={"mix": "calib.txt"}, tune=Recalibration(steps=40))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

from rich.console import Console

from moetool.edit.layout import EditError, MoELayout, read_layout
from moetool.edit.options import check_precision, check_unread_data
from moetool.edit.run import EditResult, TuneOptions, WriteOptions, run
from moetool.edit.tune import Recalibration, data_files, data_sources
from moetool.eval.residency import eval_need
from moetool.progress import silent

if TYPE_CHECKING:
    from moetool.edit.scoring import ExpertStats

__all__ = [
    "EditResult",
    "Recalibration",
    "TuneOptions",
    "WriteOptions",
    "add",
    "calibration_text",
    "check_precision",
    "check_unread_data",
    "extract",
    "listing",
    "prune",
    "remove",
]


def _local(ref: str | Path, what: str) -> Path:
    """A model folder from a path, ``zoo:NAME`` or a Hub id already in the local cache (nothing is downloaded).

    Raises:
        EditError: nothing local matches, naming the option.
    """
    from moetool.errors import SourceError
    from moetool.io.sources import resolve_source

    try:
        return resolve_source(str(ref)).path
    except SourceError as exc:
        raise EditError(f"{what}: {exc}") from None


def calibration_text(data: dict[str, str], *, seed: int = 0) -> dict[str, str]:
    """Each ``NAME → FILE | zoo:DOMAIN`` source's training split (the held-out split stays out of calibration).

    Raises:
        EditError: no source given, or a missing file.
    """
    from moetool.train.data import load_source

    if not data:
        raise EditError("calibration needs text: give --data NAME=FILE (or NAME=zoo:DOMAIN)")
    out = {}
    for name, src in data_sources(data).items():
        train, _ = load_source(name, src, base_dir=None, fraction=0.1, seed=seed)
        out[name] = train
    return out


def _scored(
    layout: MoELayout, data: dict[str, str], seed: int, max_tokens: int, reap: bool, options: TuneOptions
) -> ExpertStats:
    """Each expert's routing share (and, with ``reap``, REAP saliency) on the calibration text of ``data``.

    The model is checked to fit first, then runs in ``options``' dtype on its device.
    """
    from moetool.edit.scoring import expert_stats

    texts = calibration_text(data, seed=seed)
    dtype, device = options.get("dtype"), options.get("device")
    eval_need(layout.path, dtype=dtype, seq_len=256, batch_size=1).check()
    names = list(layout.names)
    console = options.get("console")
    return expert_stats(
        layout.path, texts, names=names, max_tokens=max_tokens, reap=reap, dtype=dtype, device=device, console=console
    )


def listing(
    moe: str | Path,
    data: dict[str, str] | None = None,
    *,
    max_tokens: int = 8192,
    dtype: str | None = None,
    device: str | None = None,
    console: Console | None = None,
    json_file: Path | None = None,
) -> dict[str, Any]:
    """The MoE's experts (index, name, width); with ``data``, routing share and REAP saliency per layer and text.

    ``json_file``: where the listing is also written as JSON (checked before any work: never onto an input).

    Raises:
        EditError: not an MoE moetool can edit; ``dtype``/``device`` not usable, or given without ``data`` (the
            model runs only to score the experts on it).
        OutputPathError: ``json_file`` is a directory, an input or inside one, or cannot be written.
    """
    from moetool.io.atomic import atomic_write_text
    from moetool.io.checks import check_report_path

    path = _local(moe, "MOE")
    if json_file is not None:
        check_report_path(json_file, [path, *data_files(data)])
    layout = read_layout(path)
    check_precision(layout.path, dtype, device, runs=bool(data), why="list runs the model only to score --data")
    report: dict[str, Any] = {
        "path": str(layout.path),
        "architecture": layout.arch.name,
        "experts": list(layout.names),
        "top_k": layout.top_k,
        "moe_layers": list(layout.moe_layers),
        "width": layout.width(),
        "dtype": layout.dtype,
        "shared_expert": layout.shared,
        "edits": [e.get("summary", e.get("op")) for e in layout.meta.get("edits", [])],
    }
    if data:
        stats = _scored(layout, data, 0, max_tokens, True, TuneOptions(dtype=dtype, device=device, console=console))
        report["routing"] = stats.to_json()
    if json_file is not None:
        atomic_write_text(Path(json_file), json.dumps(report, indent=2))
    return report


def remove(
    moe: str | Path,
    refs: list[str],
    out: str | Path,
    *,
    top_k: int | None = None,
    data: dict[str, str] | None = None,
    **options: Unpack[TuneOptions],
) -> EditResult:
    """The MoE without the experts ``refs`` (names or indices), every other tensor bit for bit.

    ``options``: how it is written and checked, and the router recalibration after (:class:`TuneOptions`).

    Raises:
        EditError: an unknown expert, too few left; ``data``, ``dtype`` or ``device`` that nothing would read
            (``data`` and ``dtype`` serve recalibration, ``device`` it and the parity check) or not usable.
    """
    from moetool.edit.remove import remove_plan

    layout = read_layout(_local(moe, "MOE"))
    tune = options.get("tune")
    steps = tune.steps if tune is not None else 0
    check_unread_data(data, steps)
    why = "remove computes nothing in it without --tune-steps"
    check_precision(layout.path, options.get("dtype"), None, runs=bool(steps), why=why)
    runs = bool(steps) or options.get("verify", True)
    why = "with --no-check and no --tune-steps remove runs no model"
    check_precision(layout.path, None, options.get("device"), runs=runs, why=why)
    return run(remove_plan(layout, refs, top_k=top_k), Path(out), data=data, **options)


def extract(moe: str | Path, ref: str, out: str | Path, **options: Unpack[WriteOptions]) -> EditResult:
    """Expert ``ref`` (name, index or ``shared``) as a dense model of the base family.

    A moetool-built MoE gives back the source expert bit for bit. ``options``: how it is written and checked.
    """
    from moetool.edit.remove import extract as extract_plan

    return run(extract_plan(_local(moe, "MOE"), ref), Path(out), **options)


def prune(
    moe: str | Path,
    out: str | Path,
    *,
    keep: float,
    by: str,
    data: dict[str, str],
    per_layer: bool = False,
    power_of_two: bool = False,
    top_k: int | None = None,
    seed: int = 0,
    max_tokens: int = 8192,
    **options: Unpack[TuneOptions],
) -> EditResult:
    """Keep ``keep`` experts per layer (a count, or a fraction below 1) chosen ``by`` reap, frequency or random.

    The experts are scored on the calibration ``data``; the per-layer report goes into ``moetool.json``.
    ``options``: how it is written and checked, and the router recalibration after (:class:`TuneOptions`).

    Raises:
        EditError: an unknown criterion, a budget that keeps all or none, fewer experts than ``top_k``.
    """
    from moetool.edit.execute import check_not_input
    from moetool.edit.prune import CRITERIA, budget, choose, prune_plan
    from moetool.io.atomic import check_output

    if by not in CRITERIA:
        raise EditError(f"--by {by!r}: choose one of {', '.join(CRITERIA)}")
    dtype, device = options.get("dtype"), options.get("device")
    path = _local(moe, "MOE")
    check_not_input(Path(out), [path, *data_files(data)])  # before minutes of calibration
    check_output(Path(out), force=options.get("force", False))
    layout = read_layout(path)
    n = budget(layout.n_experts, keep, power_of_two=power_of_two)
    check_precision(layout.path, dtype, device)
    k = top_k if top_k is not None else layout.top_k
    if k > n:
        raise EditError(
            f"--keep {keep}: {n} expert(s) per layer is below the MoE's top-k ({layout.top_k}); keep at least "
            f"{layout.top_k}, or lower it with --top-k"
        )
    stats = _scored(layout, data, seed, max_tokens, by == "reap", options)
    choice = choose(stats, n, by, per_layer=per_layer, seed=seed)
    plan = prune_plan(layout, choice, top_k=top_k, data=sorted(data.values()))
    plan.record["calibration_tokens"] = stats.tokens
    return run(plan, Path(out), data=data, **options)


def _add_record(
    layout: MoELayout, name: str, origin: dict[str, str], prompts: list[str], negative: list[str]
) -> dict[str, Any]:
    """The edit record ``moetool.json`` keeps of an ``add``."""
    before, after = layout.n_experts, layout.n_experts + 1
    return {
        "op": "add",
        "moe": str(layout.path.resolve()),
        "name": name,
        **origin,
        "prompts": prompts,
        "negative_prompts": negative,
        "experts_before": before,
        "experts_after": after,
        "top_k": layout.top_k,
        "summary": f"added {name} ({before} → {after} experts, top-{layout.top_k})",
    }


def add(
    moe: str | Path,
    source: str | Path,
    out: str | Path,
    *,
    name: str,
    prompts: list[str],
    negative: list[str] | None = None,
    base: str | Path | None = None,
    chat_template: bool = False,
    data: dict[str, str] | None = None,
    **options: Unpack[TuneOptions],
) -> EditResult:
    """``source`` (a dense model of the MoE's base, or a baked LoRA adapter of it) as a new last expert ``name``.

    It joins every MoE layer; its router row comes from ``prompts`` through the MoE's own router inputs; top-k is kept.
    ``options``: how it is written and checked, and the router recalibration after (:class:`TuneOptions`).

    Raises:
        EditError: no prompt, a taken or malformed name, an incompatible source (every problem named).
    """
    from moetool.edit.add import (
        adapter_base,
        add_plan,
        bake_adapter,
        check_adapter,
        check_request,
        check_source,
        router_rows,
    )
    from moetool.edit.execute import check_not_input
    from moetool.io.atomic import check_output, scratch_dir

    check_request(name, prompts)
    given, tune, dry_run = options.get("console"), options.get("tune"), options.get("dry_run", False)
    console = given if given is not None else silent()
    dtype, device = options.get("dtype"), options.get("device")
    out, source = Path(out), _local(source, "--source")
    check_not_input(out, [source, *data_files(data)])
    check_output(out, force=options.get("force", False))
    layout = read_layout(_local(moe, "MOE"))
    check_unread_data(data, tune.steps if tune is not None else 0)
    check_precision(layout.path, dtype, device)
    dense_base = None
    if (source / "adapter_config.json").is_file():
        dense_base = adapter_base(source, Path(base) if base is not None else None)
        check_adapter(source, dense_base, layout)  # from headers: nothing is baked for an adapter that cannot be
    with scratch_dir(out, "add") as scratch:
        origin = {"source": str(source.resolve())}
        if dense_base is not None:
            origin |= {"adapter_base": str(dense_base.resolve())}
            source = bake_adapter(source, dense_base, scratch / "baked")
        shapes, warnings = check_source(layout, source, name)
        console.print(f"add: router row of {name!r} from {len(prompts)} prompt(s) through the MoE's router inputs …")
        if not dry_run:
            eval_need(layout.path, dtype=dtype, seq_len=128, batch_size=1).check()
        rows = (
            {}
            if dry_run
            else router_rows(layout, prompts, negative or [], chat_template=chat_template, dtype=dtype, device=device)
        )
        plan = add_plan(layout, source, name, shapes, _add_record(layout, name, origin, prompts, negative or []))
        plan.warnings += warnings
        return run(plan, out, computed=rows, data=data, **options)
