"""``moetool export | profiles | presets``: artifacts for devices, each checked in its runtime."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moetool.cli.console import console, friendly, human, out
from moetool.cli.options import TARGETS, ForOpt, JsonOpt, OldDeviceOpt, VerifyOpt, old_spelling
from moetool.errors import deprecated

ComputeUnitsOpt = Annotated[
    str | None, typer.Option(help="Core ML: ALL, CPU_ONLY, CPU_AND_GPU or CPU_AND_NE (the default).")
]
ChunkLayersOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Core ML, ExecuTorch, TFLite: decoder layers per package, program or model (default: as many as 256 MiB "
        "of float32 weights hold; one when the whole model fits). Each chunk is converted on its own, so the export "
        "holds one.",
    ),
]
JobsOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Core ML, ExecuTorch, TFLite: chunks converted at once, each in a process of its own with its share of "
        "the cores (default: as many as the cores and the available memory allow).",
    ),
]
MoeKernelOpt = Annotated[
    str | None,
    typer.Option(
        help="ONNX: sparse (the default: onnxruntime's MoE/QMoE operators, only each token's top-k experts run) or "
        "dense (every expert as standard MatMuls, for ONNX runtimes other than onnxruntime)."
    ),
]
AccuracyLevelOpt = Annotated[
    int | None,
    typer.Option(
        help="ONNX: what the 4- and 8-bit operators compute their activations in: 4 (the default: int8, fast) or 0 "
        "(fp32: exact to the rounded weights, slower)."
    ),
]
# the importance-matrix options (GGUF), as aliases: export_cmd's signature stays readable
ImatrixOpt = Annotated[
    str | None,
    typer.Option(
        help="GGUF: an importance matrix for llama.cpp's quantizer: 'auto' collects one (every expert gets "
        "tokens) on --calibration or the recipe's domain data, or a GGUF imatrix FILE. Needed by q2_k, q3_k and "
        "the IQ types; written beside the GGUF."
    ),
]
CalibrationOpt = Annotated[
    Path | None, typer.Option(help="Calibration text file for --imatrix auto (default: the recipe's data).")
]
ImatrixModeOpt = Annotated[
    str | None,
    typer.Option(
        help="--imatrix auto: 'routed' (each expert over its routed tokens; one under --imatrix-floor tokens "
        "over every token) or 'all' (every expert over every token)."
    ),
]
ImatrixFloorOpt = Annotated[
    int | None, typer.Option(min=0, help="--imatrix auto, routed: fewest tokens an expert may have (128).")
]


@friendly
def export_cmd(
    model: Annotated[str, typer.Argument(help="Model directory (any method's output), zoo:NAME, or a PEFT adapter.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Artifact directory (artifact + manifest.json).")],
    target: Annotated[
        str | None,
        typer.Option(
            help=f"The export format: {TARGETS} (default: the --for profile's first format, else gguf; a method's "
            "output: its own default)."
        ),
    ] = None,
    quant: Annotated[
        str | None,
        typer.Option(
            help="Preset (gem, moe-q4, …), type (q8_0, …) or rules 'experts=q4_k,attention=q8_0,*=q8_0'. "
            "Default: the recipe's quantization section, else f16 for gguf and f32 for the graph targets."
        ),
    ] = None,
    for_: ForOpt = None,
    context: Annotated[int | None, typer.Option(min=1, help="Context length for the memory estimate.")] = None,
    eval_text: Annotated[Path | None, typer.Option(help="Held-out text file for the parity check.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan and memory estimate; write nothing.")
    ] = False,
    verify: VerifyOpt = True,
    compute_units: ComputeUnitsOpt = None,
    chunk_layers: ChunkLayersOpt = None,
    jobs: JobsOpt = None,
    moe_kernel: MoeKernelOpt = None,
    accuracy_level: AccuracyLevelOpt = None,
    imatrix: ImatrixOpt = None,
    calibration: CalibrationOpt = None,
    imatrix_mode: ImatrixModeOpt = None,
    imatrix_floor: ImatrixFloorOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    base: Annotated[
        str | None,
        typer.Option(
            help="Base model of a PEFT adapter given as MODEL (default: the adapter's base_model_name_or_path)."
        ),
    ] = None,
    old_device: OldDeviceOpt = None,
) -> None:
    """Export a model for a device, with a per-tensor precision plan, verified in the target runtime.

    Every method's output exports here (GEM, routed embeddings, hybrid, CoMiGS users baked to Mixtral). Given a PEFT
    LoRA adapter directory, writes a GGUF adapter for llama.cpp's --lora, checked against the base with it merged.
    """
    from moetool import api
    from moetool.cli.render import print_export_need, print_export_plan, print_manifest, print_output_check
    from moetool.errors import MoetoolError
    from moetool.export.gguf.lora import is_adapter
    from moetool.io.safe import read_text

    profile = old_spelling("export", "--device", old_device, for_)
    if eval_text and not verify:
        raise MoetoolError("--eval-text is the text the verification runs on; --no-verify skips it, so leave it out")
    text = read_text(eval_text, what="--eval-text") if eval_text else None
    calib = read_text(calibration, what="--calibration") if calibration else None
    if base is not None and not is_adapter(Path(model)):
        raise MoetoolError(f"--base is the base model of a PEFT adapter, and {model} is not one; leave it out")
    if is_adapter(Path(model)):
        if dry_run or imatrix or calibration:
            raise typer.BadParameter("--dry-run, --imatrix and --calibration are for models, not adapters")
        return _export_adapter(model, output, base=base, quant=quant, force=force, verify=verify, text=text)
    job = api.plan_export(
        model, output, target=target, quant=quant, for_=profile, force=force, verify=verify, eval_text=text,
        context=context, imatrix=imatrix, calibration=calib, imatrix_mode=imatrix_mode,
        imatrix_min_tokens=imatrix_floor, compute_units=compute_units, chunk_layers=chunk_layers, jobs=jobs,
        moe_kernel=moe_kernel, accuracy_level=accuracy_level,
    )  # fmt: skip
    label = getattr(getattr(job.plan, "quant", None), "label", "")
    print_export_plan(job.exporter, job.plan, f"{job.exporter.name} plan '{label}' for {job.plan.name}")
    if dry_run:
        print_export_need(job.need())
        print_output_check(output, force)
        return
    with console.status(f"writing and verifying {job.exporter.name} …"):
        manifest = job.run(console)
    print_manifest(output, manifest)


def _export_adapter(
    model: str, output: Path, *, base: str | None, quant: str | None, force: bool, verify: bool, text: str | None
) -> None:
    """A PEFT LoRA adapter written as a GGUF adapter, checked against the base with it merged."""
    from moetool import api
    from moetool.cli.render import print_manifest

    with console.status("writing and verifying the GGUF adapter …"):
        manifest = api.export(model, output, base=base, quant=quant, force=force, verify=verify, eval_text=text)
    print_manifest(output, manifest)


def profiles(as_json: JsonOpt = False) -> None:
    """Deployment profiles (the values of --for): memory budget, formats in order of preference, precisions, plans
    tried."""
    from dataclasses import asdict

    from moetool.quant.devices import DEVICES

    if as_json:
        sys.stdout.write(json.dumps({n: asdict(d) for n, d in DEVICES.items()}, indent=2) + "\n")
        return
    t = Table(title="deployment profiles (--for)")
    for col in ("profile", "memory", "budget", "formats", "plans tried (best first)", "note"):
        t.add_column(col)
    for d in DEVICES.values():
        t.add_row(d.name, human(d.memory), human(d.budget), ", ".join(d.formats), ", ".join(d.ladder), d.note)
    out.print(t)


def old_devices(as_json: JsonOpt = False) -> None:
    """``moetool devices``: the old name of ``moetool profiles`` (it lists deployment profiles, the values of --for,
    not torch devices), read for one release."""
    deprecated("`moetool devices` is the old name: write `moetool profiles` (it lists the values of --for)")
    profiles(as_json)


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


def register_alias(app: typer.Typer, models: str) -> None:
    """``moetool <method> export``: the same command as ``moetool export`` under a method's group (one export door:
    every artifact is written by :meth:`~moetool.export.base.ExportJob.run`)."""
    app.command(
        "export",
        help=f"The same command as `moetool export` (an alias kept for {models}; prefer `moetool export`): every "
        "method's output exports there, with the same options and checks.",
    )(export_cmd)


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
    app.command()(profiles)
    app.command("devices", hidden=True, help="The old name of `moetool profiles`.")(old_devices)
    app.command()(presets)
