"""Resolve a standard export without writing: target, quantization plan and memory estimate.

Shared by the pipeline (:func:`moetool.api.plan_export`, for a standard model) and by methods that export their parts (a GEM pathway, a
hybrid expert) through the standard exporters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict, Unpack

from pydantic import ValidationError

from moetool.export.base import TARGETS, ExportError, ExportJob, ExportRequest, get_exporter
from moetool.export.planning import ArtifactPlan
from moetool.io.safe import read_yaml
from moetool.quant.devices import get_device
from moetool.quant.plan import QuantSpec, parse_quant


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
    elif target not in dev.formats:
        raise ExportError(f"{dev.name} runs {', '.join(dev.formats)}, not {target}")
    return target, dev


def quant_spec_of_model(model_dir: Path) -> QuantSpec | None:
    """The ``quantization:`` section of the recipe a model was merged from (kept as moetool-recipe.yaml), if any."""
    path = Path(model_dir) / "moetool-recipe.yaml"
    if not path.is_file():
        return None
    data = read_yaml(path, what="the model's recipe", error=ExportError) or {}
    if not isinstance(data, dict):
        raise ExportError(f"{path}: the model's recipe is not a YAML mapping")
    section = data.get("quantization")
    if section is None:
        return None
    try:
        return QuantSpec.model_validate(section)
    except ValidationError as exc:  # one sentence naming the key, not pydantic's dump
        reasons = "; ".join(_reason(e) for e in exc.errors())
        raise ExportError(f"{path}: quantization: {reasons}") from None


def _reason(error: Any) -> str:
    """One pydantic error as ``field.path: message``."""
    loc = ".".join(str(p) for p in error.get("loc", ()))
    msg = str(error["msg"]).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def resolve_quant(
    model_dir: Path, quant: QuantSpec | str | None, device: str | None, default: str = "f16"
) -> QuantSpec:
    """``quant`` as given (``--quant`` text parsed), else the model's recipe section, else the device's best
    fitting plan when a device is given, else ``default`` (the target's own default plan)."""
    try:
        spec = parse_quant(quant) if isinstance(quant, str) else quant
    except ValidationError as exc:  # one sentence, not pydantic's dump with its links
        reasons = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        raise ExportError(f"--quant {quant!r}: {reasons}") from None
    except ValueError as exc:
        raise ExportError(f"--quant {quant!r}: {exc}") from None
    if spec is None:
        spec = quant_spec_of_model(model_dir)
    if spec is None:
        spec = QuantSpec() if device is not None else QuantSpec(preset=default)
    return spec


class ExportOptions(TypedDict, total=False):
    """What ``moetool export`` takes besides the model and the output (every key optional)."""

    target: str | None  # gguf, onnx, …; default: the device's first available format, else gguf
    quant: QuantSpec | str | None  # a QuantSpec or --quant text; default: the model's recipe section, else the target's
    device: str | None  # a device profile: its format and the best plan that fits its budget
    force: bool  # replace an existing output
    verify: bool  # check the artifact in its runtime (default True)
    eval_text: str | None  # held-out text for the parity check
    context: int | None  # context length for the memory estimate


def plan_standard_export(model_dir: Path, output: str | Path, **opts: Unpack[ExportOptions]) -> ExportJob[ArtifactPlan]:
    """The planned export (exporter, request, plan) of a standard transformers model in ``model_dir``; writes
    nothing. :meth:`ExportJob.run` writes it.

    Raises:
        ExportError: an unknown target or device, a target the device does not run, a bad ``quant``, a plan that
            does not fit the device, or a model the target cannot take.
    """
    device = opts.get("device")
    target, _ = resolve_target(device, opts.get("target"))
    exporter = get_exporter(target)
    spec = resolve_quant(Path(model_dir), opts.get("quant"), device, exporter.default_quant)
    req = ExportRequest(
        model_dir=Path(model_dir),
        output=Path(output),
        quant=spec,
        device=device,
        verify=opts.get("verify", True),
        force=opts.get("force", False),
        eval_text=opts.get("eval_text"),
        context=opts.get("context"),
    )
    return ExportJob(exporter, req, exporter.plan(req))
