"""Resolve a standard export without writing: target, quantization plan and memory estimate.

Shared by the pipeline (:func:`moetool.api.plan_export`, for a standard model) and by methods that export their parts (a GEM pathway, a
hybrid expert) through the standard exporters.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict, Unpack

from pydantic import ValidationError

from moetool.export.base import TARGETS, ExportError, ExportJob, ExportRequest, get_exporter
from moetool.export.planning import ArtifactPlan
from moetool.io.mlx_folder import check_not_mlx_folder
from moetool.quant.devices import get_device
from moetool.quant.imatrix import MODES, Calibration
from moetool.quant.plan import QuantSpec, parse_quant
from moetool.recipe.base import RecipeBase
from moetool.recipe.kept import read_kept_recipe
from moetool.recipe.train import TrainSpec


def resolve_target(device: str | None, target: str | None) -> tuple[str, Any]:
    """The target (given, else the device's first available format, else gguf) and the device profile."""

    try:
        dev = get_device(device) if device is not None else None
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    if dev is None:
        return target or "gguf", None
    if target is None:
        target = next((f for f in dev.formats if f in TARGETS), None)
        if target is None:
            raise ExportError(f"{dev.name} prefers {', '.join(dev.formats)}; none is available yet")
    elif (why := dev.not_run(target)) is not None:
        raise ExportError(why)
    return target, dev


def model_recipe(model_dir: Path, given: RecipeBase | None = None) -> RecipeBase | None:
    """The recipe ``model_dir`` was built from: ``given`` (``api.build`` passes the recipe it runs), else the one the
    folder keeps (``moetool-recipe.yaml``, read and validated by :func:`~moetool.recipe.kept.read_kept_recipe`).

    Raises:
        RecipeError: the kept recipe is not a valid recipe (file, field and line named).
    """
    return given if given is not None else read_kept_recipe(model_dir)


def recipe_quant(recipe: RecipeBase | None) -> QuantSpec | None:
    """The recipe's ``quantization:`` section, where its method has one and it is given."""
    spec = getattr(recipe, "quantization", None)
    return spec if isinstance(spec, QuantSpec) else None


def resolve_quant(
    model_dir: Path,
    quant: QuantSpec | str | None,
    device: str | None,
    default: str = "f16",
    *,
    recipe: RecipeBase | None = None,
) -> QuantSpec:
    """``quant`` as given (``--quant`` text parsed), else the quantization section of the model's recipe
    (``recipe``, else the one ``model_dir`` keeps), else the device's best fitting plan when a device is given, else
    ``default`` (the target's own default plan)."""
    try:
        spec = parse_quant(quant) if isinstance(quant, str) else quant
    except ValidationError as exc:  # one sentence, not pydantic's dump with its links
        reasons = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        raise ExportError(f"--quant {quant!r}: {reasons}") from None
    except ValueError as exc:
        raise ExportError(f"--quant {quant!r}: {exc}") from None
    if spec is None:
        spec = recipe_quant(model_recipe(model_dir, recipe))
    if spec is None:
        spec = QuantSpec() if device is not None else QuantSpec(preset=default)
    return spec


# exporter options (ExportRequest.options): the command-line flag, and the targets that read it (space-separated)
TARGET_OPTIONS: dict[str, tuple[str, str]] = {
    "compute_units": ("--compute-units", "coreml"),
    "chunk_layers": ("--chunk-layers", "coreml executorch tflite"),
    "jobs": ("--jobs", "coreml executorch tflite"),
    "moe_kernel": ("--moe-kernel", "onnx"),
    "accuracy_level": ("--accuracy-level", "onnx"),
}


def check_target_options(target: str, options: Mapping[str, object]) -> None:
    """Refuse an exporter option given for a target that never reads it (None: not given).

    Raises:
        ExportError: naming the flag, the target that reads it and the one planned.
    """
    for key, value in options.items():
        flag, readers = TARGET_OPTIONS[key]
        if value is not None and target not in readers.split():
            names = readers.split()
            which = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
            reads = "targets read" if len(names) > 1 else "target reads"
            raise ExportError(f"{flag} {value}: only the {which} {reads} it, not {target}; leave it out")


def target_options(target: str, opts: ExportOptions) -> dict[str, Any]:
    """The request's exporter options for ``target``: the target options given (each checked to be read by
    ``target``) and a method exporter's own ``options``, fixed at planning time.

    Raises:
        ExportError: a target option for a target that does not read it.
    """
    given = {key: opts.get(key) for key in TARGET_OPTIONS}
    check_target_options(target, given)
    return {**(opts.get("options") or {}), **{k: v for k, v in given.items() if v is not None}}


# what a method's own exporter never reads (it picks its own format and precision), by the flag that sets it
STANDARD_ONLY = {
    "--for (a deployment profile)": ("for_", "device"),
    "--imatrix": ("imatrix", "calibration", "imatrix_mode", "imatrix_min_tokens"),
    "--compute-units": ("compute_units",),
    "--chunk-layers": ("chunk_layers",),
    "--jobs": ("jobs",),
    "--moe-kernel": ("moe_kernel",),
    "--accuracy-level": ("accuracy_level",),
}


def check_method_options(model_dir: Path, method: str, opts: ExportOptions) -> None:
    """Refuse, for an output of ``method`` (its own exporter), the options only a standard MoE's export reads.

    Raises:
        ExportError: naming the model, its method and the flag.
    """
    for flag, keys in STANDARD_ONLY.items():
        if any(opts.get(k) is not None for k in keys):
            target = "; use --target" if "for_" in keys else ""
            raise ExportError(f"{model_dir} is a {method} model: {flag} applies to standard MoE models{target}")


class ExportOptions(TypedDict, total=False):
    """What ``moetool export`` takes besides the model and the output (every key optional)."""

    target: str | None  # gguf, onnx, …; default: the device's first available format, else gguf
    quant: QuantSpec | str | None  # a QuantSpec or --quant text; default: the model's recipe section, else the target's
    for_: str | None  # a deployment profile (`moetool profiles`): its format and the best plan that fits its budget
    device: str | None  # the old keyword of for_ (read with a DeprecationWarning in this release only)
    force: bool  # replace an existing output
    verify: bool  # check the artifact in its runtime (default True)
    eval_text: str | None  # held-out text for the parity check
    context: int | None  # context length for the memory estimate
    imatrix: str | Path | Calibration | None  # "auto", a GGUF imatrix file, or a Calibration (GGUF only)
    calibration: str | None  # calibration text for imatrix "auto" (default: the model recipe's domain data)
    imatrix_mode: str | None  # routed (default) or all
    imatrix_min_tokens: int | None  # routed mode's floor per expert (default 128)
    compute_units: str | None  # Core ML's compute units (coreml only)
    chunk_layers: int | None  # decoder layers per package, program or model (coreml, executorch, tflite)
    jobs: int | None  # chunks converted at once, a process each (coreml, executorch, tflite); default: what fits
    moe_kernel: str | None  # ONNX's MoE operators, sparse or dense (onnx only)
    accuracy_level: int | None  # ONNX's 4/8-bit operators: 4 (int8 activations, the default) or 0 (fp32) (onnx only)
    options: dict[str, Any] | None  # a method exporter's own settings (hybrid: experts=False, the router only)
    recipe: RecipeBase | None  # the recipe the model was built from (default: the one its folder keeps)


def deployment_profile(opts: ExportOptions) -> str | None:
    """The deployment profile of ``opts``: ``for_``, or ``device``, its old keyword, with a DeprecationWarning.

    Raises:
        ExportError: both keywords given.
    """
    old = opts.get("device")
    if old is None:
        return opts.get("for_")
    if opts.get("for_") is not None:
        raise ExportError(
            "device= is the old keyword of for_= (the deployment profile), which is also given; keep for_="
        )
    warnings.warn(
        f"device={old!r} is the old keyword of the deployment profile: write for_={old!r} (as `moetool export --for`; "
        "device names the torch device everywhere else, and is read here in this release, not in the next)",
        DeprecationWarning,
        stacklevel=4,
    )
    return old


def plan_standard_export(model_dir: Path, output: str | Path, **opts: Unpack[ExportOptions]) -> ExportJob[ArtifactPlan]:
    """The planned export (exporter, request, plan) of a standard transformers model in ``model_dir``; writes
    nothing. :meth:`ExportJob.run` writes it.

    Raises:
        ExportError: an unknown target or device, a target the device does not run, a bad ``quant``, a plan that
            does not fit the device, or a model the target cannot take.
        SourceError: ``model_dir`` is an MLX export (mlx-lm's layout), which no target reads.
    """
    check_not_mlx_folder(Path(model_dir))
    device = deployment_profile(opts)
    target, _ = resolve_target(device, opts.get("target"))
    exporter = get_exporter(target)
    options = target_options(target, opts)
    recipe = model_recipe(Path(model_dir), opts.get("recipe"))
    spec = resolve_quant(Path(model_dir), opts.get("quant"), device, exporter.default_quant, recipe=recipe)
    if spec.budget is not None and target != "gguf":
        quant = opts.get("quant")
        given = f"--quant {quant!r}" if isinstance(quant, str) else "quantization: budget (the model's recipe)"
        raise ExportError(
            f"{given}: a size budget is for the gguf target only (bits are allocated over llama.cpp's quantization "
            f"types); {target} takes a preset, a type or rules"
        )
    req = ExportRequest(
        model_dir=Path(model_dir),
        output=Path(output),
        quant=spec,
        device=device,
        verify=opts.get("verify", True),
        force=opts.get("force", False),
        eval_text=opts.get("eval_text"),
        context=opts.get("context"),
        options=options,
        imatrix=resolve_imatrix(Path(model_dir), target, opts, recipe),
    )
    return ExportJob(exporter, req, exporter.plan(req))


def resolve_imatrix(
    model_dir: Path, target: str, opts: ExportOptions, recipe: RecipeBase | None
) -> Path | Calibration | None:
    """``imatrix`` as the exporter takes it: a file, or the calibration to collect one on (``auto``: the
    ``calibration`` text, else the training split of every domain of ``recipe``, the model's recipe).

    Raises:
        ExportError: an imatrix for a target other than GGUF, a missing file, calibration options without
            ``--imatrix auto``, or ``auto`` with no text to calibrate on.
    """
    given = opts.get("imatrix")
    extra = [k for k in ("calibration", "imatrix_mode", "imatrix_min_tokens") if opts.get(k) is not None]
    if given is None:
        if extra:
            raise ExportError(f"--{extra[0].replace('_', '-')} is for --imatrix auto")
        return None
    if target != "gguf":
        raise ExportError(f"--imatrix is for the gguf target (llama.cpp's quantizer), not {target}")
    if isinstance(given, Calibration):
        return given
    if str(given) != "auto":
        if extra:
            raise ExportError(f"--{extra[0].replace('_', '-')} is for --imatrix auto, not an imatrix file")
        path = Path(given)
        if not path.is_file():
            raise ExportError(f"--imatrix {given}: no such file (or pass --imatrix auto to collect one)")
        return path
    mode = opts.get("imatrix_mode") or "routed"
    if mode not in MODES:
        raise ExportError(f"--imatrix-mode {mode!r}: choose {' or '.join(MODES)}")
    floor = opts.get("imatrix_min_tokens")
    text = opts.get("calibration")
    if text is not None:
        if not text.strip():  # tokenized, whitespace still gives a few windows: a matrix measured on nothing
            raise ExportError("--calibration: the file has no text (only whitespace); give it calibration text")
        texts, source = {"calibration": text}, "--calibration"
    else:
        texts, source = recipe_domain_text(recipe, model_dir), "the recipe's domain data (training split)"
    return Calibration(texts, source=source, mode=mode, min_tokens=128 if floor is None else floor)


def recipe_domain_text(recipe: RecipeBase | None, model_dir: Path) -> dict[str, str]:
    """Each domain's training split from ``train.data`` of the recipe the model was built from.

    Raises:
        ExportError: no recipe, or one without ``train.data``, naming ``--calibration``; a domain whose text
            cannot be read.
    """
    from moetool.errors import MoetoolError
    from moetool.train.data import load_source  # torch: only for --imatrix auto

    train = getattr(recipe, "train", None)
    given = recipe is not None and "train" in recipe.model_fields_set
    data = train.data if given and isinstance(train, TrainSpec) and "data" in train.model_fields_set else {}
    if recipe is None or not data:
        raise ExportError(
            f"--imatrix auto: {model_dir} has no recipe with train.data to calibrate on; pass --calibration FILE"
        )
    out = {}
    for name, src in data.items():
        try:
            out[name] = load_source(name, src, base_dir=recipe.recipe_dir, fraction=0.1, seed=0)[0]
        except MoetoolError as exc:
            where = recipe.path or recipe.name
            raise ExportError(f"--imatrix auto: {where}: train.data.{name}: {exc}; pass --calibration FILE") from None
    return out
