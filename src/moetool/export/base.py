"""What every exporter shares: the request, the protocol, the manifest, the registry of targets."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from rich.console import Console

from moetool import registry
from moetool.errors import MoetoolError, OutputPathError
from moetool.export.gate import GateReport
from moetool.export.parity import (
    NOT_VERIFIED,  # noqa: F401  (re-exported: exporters import it from here)
    ParityRecord,
    parity_of,
)
from moetool.io.atomic import check_output
from moetool.io.budget import Need
from moetool.io.files import weights_sha256
from moetool.io.hashes import sha256_file
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.io.safe import read_json
from moetool.quant.devices import MemoryEstimate
from moetool.quant.imatrix import Calibration
from moetool.quant.plan import QuantPlan, QuantSpec


@dataclass(frozen=True)
class Origin:
    """Where an artifact's model came from when the exporter reads a derived copy.

    For a CoMiGS user baked into a Mixtral in a temporary folder: the manifest names ``path``, not the copy, and
    records ``record`` under ``key``, in the one write of the manifest.

    Attributes:
        path: the model the user named.
        key: the manifest field that holds ``record`` (one of :data:`ORIGIN_KEYS`).
        record: what the derivation was (e.g. ``comigs_user``).
        parity: the derived copy against the model the user named, written as the record's ``parity``.
    """

    path: Path
    key: str
    record: JsonObject
    parity: ParityRecord | None = None

    def to_json(self) -> JsonObject:
        """The manifest field: ``record``, with ``parity`` where the derivation was checked."""
        return self.record | ({"parity": self.parity.to_json()} if self.parity is not None else {})


# the manifest fields an Origin is written under: a CoMiGS user baked into a Mixtral
ORIGIN_KEYS = ("baked_from",)


@dataclass
class ArtifactPlan:
    """What an exporter decided before writing: the model, its precision plan and the memory estimate."""

    model_dir: Path
    config: dict[str, Any]
    quant: QuantPlan
    name: str
    device: str | None = None
    memory: MemoryEstimate | None = None
    context: int = 2048
    candidates: list[tuple[str, int, bool]] = field(default_factory=list)  # (plan, estimate, fits) when --for
    origin: Origin | None = None  # the request's, for the manifest
    options: dict[str, Any] = field(default_factory=dict)  # the target options planned (compute_units, moe_kernel)


class ExportError(MoetoolError):
    """The model cannot be exported to the target as asked, or the artifact failed its parity check."""


@dataclass
class ExportRequest:
    """What to export and how: the model, the output folder, the precision, the device and the checks.

    Attributes:
        model_dir: the model folder the exporter reads.
        output: the artifact folder (artifact + manifest.json), written atomically.
        quant: the precision plan's spec (a preset, a type, or rules by role and glob).
        device: a device profile whose budget the plan must fit.
        verify: check the artifact in its runtime (parity at two sequence lengths).
        force: replace an existing output.
        eval_text: held-out text for parity; default: the zoo's or a built-in sample.
        context: context length for the memory estimate (default: the device's).
        options: exporter-specific settings (``compute_units``, ``moe_kernel``, a method's ``quant``).
        origin: set when ``model_dir`` is a derived copy of the model the user named.
        imatrix: an importance matrix for llama.cpp's quantizer: a GGUF imatrix file, or the calibration to collect
            one on (GGUF only; needed by the types in ``quant.types.NEEDS_IMATRIX``).
    """

    model_dir: Path
    output: Path
    quant: QuantSpec
    device: str | None = None
    verify: bool = True
    force: bool = False
    eval_text: str | None = None  # held-out text for parity; default: the zoo's or a built-in sample
    context: int | None = None  # context length for the memory estimate (default: the device's)
    options: dict[str, Any] = field(default_factory=dict)
    origin: Origin | None = None  # set when model_dir is a derived copy of the model the user named
    imatrix: Path | Calibration | None = None

    @property
    def named_model(self) -> Path:
        """The model the user named: ``origin.path`` for a derived copy, else ``model_dir``."""
        return self.origin.path if self.origin else self.model_dir


class Manifest(dict[str, JsonValue]):
    """An artifact's manifest, with typed fields for its readers: the CLI, the build, bundles, packaging.

    It is the document itself (a ``dict``), so it serialises and compares as the JSON on disk does; :meth:`of` checks
    the fields every manifest must have, so an exporter that returns a malformed one fails where it returns.
    """

    @classmethod
    def of(cls, doc: Mapping[str, JsonValue], *, source: str) -> Manifest:
        """``doc`` checked: a non-empty string ``format``, and ``target``/``file`` strings where present.

        Raises:
            ExportError: a field is missing or of the wrong type, naming ``source`` (the exporter or the file).
        """
        if isinstance(doc, Manifest):
            return doc
        if not isinstance(doc.get("format"), str) or not doc.get("format"):
            raise ExportError(f"{source}: a manifest without a format (keys: {', '.join(sorted(doc)) or 'none'})")
        for key in ("target", "file"):
            if key in doc and not isinstance(doc[key], str):
                raise ExportError(f"{source}: manifest field {key!r} is {doc[key]!r}, not a string")
        return cls(doc)

    @property
    def format(self) -> str:
        """``moetool-artifact/1`` for the standard targets; a method's own format for its artifacts."""
        return str(self["format"])

    @property
    def target(self) -> str | None:
        """The target the artifact is for (``gguf``, ``onnx``, …), where the format names one."""
        value = self.get("target")
        return value if isinstance(value, str) else None

    @property
    def file(self) -> str | None:
        """The artifact's main file, relative to its folder (a bundle's router graph)."""
        value = self.get("file")
        return value if isinstance(value, str) else None

    def part(self, key: str) -> JsonObject:
        """The object under ``key`` (``model``, ``artifact``, ``plan``, …); empty where it is absent or not one."""
        value = self.get(key)
        return value if isinstance(value, dict) else {}

    @property
    def artifact_bytes(self) -> int | None:
        """The artifact's size (``artifact.bytes``)."""
        value = self.part("artifact").get("bytes")
        return value if isinstance(value, int) else None

    @property
    def file_hashes(self) -> dict[str, str | None]:
        """Every listed file (``files``: relative path → sha256); ``file`` with ``artifact.sha256`` where none is."""
        listed = self.part("files")
        if not listed:
            sha = self.part("artifact").get("sha256")
            return {str(self.file): sha if isinstance(sha, str) else None}
        hashes = {rel: info.get("sha256") if isinstance(info, dict) else None for rel, info in listed.items()}
        return {rel: sha if isinstance(sha, str) else None for rel, sha in hashes.items()}

    @property
    def model_path(self) -> str | None:
        """The model the artifact was exported from (``model.path``)."""
        value = self.part("model").get("path")
        return value if isinstance(value, str) else None

    @property
    def weights_sha256(self) -> dict[str, str]:
        """That model's weight files and their sha256 (``model.weights_sha256``)."""
        hashes = self.part("model").get("weights_sha256")
        return {n: h for n, h in hashes.items() if isinstance(h, str)} if isinstance(hashes, dict) else {}

    @property
    def notes(self) -> list[str]:
        """What the plan and the conversion noted (``notes``)."""
        value = self.get("notes")
        return [n for n in value if isinstance(n, str)] if isinstance(value, list) else []

    @property
    def parity(self) -> ParityRecord | str | None:
        """The parity record against the PyTorch model, or why there is none (``--no-verify``).

        None where the manifest has no ``parity``.
        """
        return parity_of(self.get("parity"))

    @property
    def gate(self) -> GateReport | None:
        """The margin gate's figures and verdict (a GGUF's ``parity.gate``; None where the artifact has none)."""
        parity = self.parity
        return parity.gate if isinstance(parity, ParityRecord) else None

    @property
    def origin(self) -> tuple[str, str, ParityRecord | str | None] | None:
        """Where a derived copy came from: the field, the model the user named, and the copy's parity against it.

        A manifest written before ``parity`` was recorded there has its one figure, ``parity_max_abs_logit_diff``.
        None where the artifact was exported from the model itself.
        """
        for key in ORIGIN_KEYS:
            record = self.get(key)
            if not isinstance(record, dict):
                continue
            model = self.get("model")
            path = model.get("path") if isinstance(model, dict) else None
            parity = parity_of(record.get("parity"))
            legacy = record.get("parity_max_abs_logit_diff")
            if parity is None and isinstance(legacy, int | float):
                parity = ParityRecord(max_abs_logit_diff=float(legacy))
            return key, str(path or record.get("comigs_user") or "?"), parity
        return None

    @property
    def verified(self) -> bool:
        """Whether the artifact was checked in its runtime (its parity is figures, not a reason)."""
        return isinstance(self.parity, ParityRecord)


PlanT = TypeVar("PlanT")


class Exporter(Protocol[PlanT]):
    """A target's exporter, generic over its plan.

    ``PlanT`` is what its :meth:`plan` decides (an :class:`ArtifactPlan` for the standard targets), and
    :meth:`export` takes that same plan back.
    """

    name: str
    requires: str  # the pip extra that provides the runtime used for verification
    default_quant: str  # the plan when neither --quant, the model's recipe nor --for gives one

    def plan(self, req: ExportRequest) -> PlanT:
        """Resolve the quantization plan (no writes)."""
        ...

    def export(self, req: ExportRequest, plan: PlanT, console: Console | None = None) -> Mapping[str, JsonValue]:
        """Write the artifact and its manifest into ``req.output`` atomically; return the manifest."""
        ...


class ExportJob(NamedTuple, Generic[PlanT]):
    """One planned export: the exporter, its request and its plan (nothing written yet).

    Unpacks as ``exporter, request, plan``; :meth:`run` is the one place an artifact is written, for the API, the
    CLI, the build and the methods that export their parts (GEM pathways, hybrid experts, baked CoMiGS users).
    """

    exporter: Exporter[PlanT]
    request: ExportRequest
    plan: PlanT

    def need(self) -> Need | None:
        """The memory and disk the export needs, estimated before anything is read.

        None when the exporter (a method's own) makes no estimate.
        """
        need = getattr(self.exporter, "need", None)
        return need(self.request, self.plan) if callable(need) else None

    def run(self, console: Console | None = None) -> Manifest:
        """Write, verify and describe the artifact; returns its manifest (also written beside it).

        Raises:
            OutputExistsError: the output exists and the request has no ``force`` (before anything is written).
            ExportError: the artifact failed its parity check, the target cannot take the model, or the exporter
                returned a malformed manifest.
        """
        check_output(self.request.output, force=self.request.force)
        return Manifest.of(self.exporter.export(self.request, self.plan, console=console), source=self.exporter.name)


# target -> "module:Class" (moetool.registry); the module is imported only when the target is used
TARGETS = registry.TARGETS


def get_exporter(target: str) -> Exporter[ArtifactPlan]:
    """The standard exporter of ``target``.

    Raises:
        ExportError: an unknown target (with "did you mean").
    """
    if target not in TARGETS:
        hint = registry.did_you_mean(target, TARGETS).split("?")[0]
        close = f" ({hint}?)" if hint.startswith("did you mean") else ""
        raise ExportError(f"unknown target {target!r}; available: {', '.join(TARGETS)}{close}")
    exporter: Exporter[ArtifactPlan] = registry.load(TARGETS[target])()
    return exporter


MANIFEST = "manifest.json"
# names of artifact files (and Core ML's package folder): an output named like one is a mistaken file name
ARTIFACT_SUFFIXES = (".gguf", ".onnx", ".tflite", ".pte", ".mlpackage")


def check_artifact_dir(output: Path | str) -> None:
    """Refuse ``-o medical.gguf``: an export's output is a directory that receives the artifact and its manifest.

    A directory of that name that holds a previous export (its ``manifest.json``) is accepted, so re-exporting
    into it with ``--force`` keeps working.

    Raises:
        OutputPathError: the name ends in an artifact suffix and is not a previous export's directory.
    """
    out = Path(output)
    suffix = out.suffix.lower()
    if suffix not in ARTIFACT_SUFFIXES or (out.is_dir() and (out / MANIFEST).is_file()):
        return
    raise OutputPathError(
        f"-o {output}: -o takes a directory, which receives the artifact and {MANIFEST} (the file is named by the "
        f"exporter); a name ending in {suffix} would become a directory. Pass e.g. -o {out.with_suffix('')}"
    )


def write_manifest(out_dir: Path, manifest: Mapping[str, JsonValue]) -> Path:
    """Write ``manifest`` as ``out_dir/manifest.json`` (inside the exporter's temporary folder); returns the path."""
    path = out_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def manifest_fields(folder: Path, model_dir: Path, main: str, *, target: str, model_type: str | None) -> JsonObject:
    """The fields packaging reads from every manifest, for an artifact written by a method's own exporter.

    The standard exporters write the same fields (``export.planning.manifest_base``); a method's artifact (a GEM
    graph, a routed-embedding graph, a bundle of a router and its members) adds them to its own document, so
    ``moetool package`` checks and copies it like any other.

    Args:
        folder: the artifact's folder as written (the exporter's temporary folder): every file in it is listed.
        model_dir: the model (or bundle) the artifact was exported from, whose weights are recorded.
        main: the artifact's main file, relative to ``folder`` (a bundle's router graph).
        target: the target the artifact is for (a bundle's: its members').
        model_type: the model's ``model_type``, where it has one.

    Returns:
        ``target``, ``file``, ``files`` (each file's bytes and sha256; ``manifest.json`` aside), ``model`` (name,
        path, model type, weights' sha256) and ``artifact`` (total bytes, sha256 of ``main``).

    Raises:
        ExportError: ``main`` was not written (an exporter's bug, named before the manifest is).
    """
    folder, model_dir = Path(folder), Path(model_dir).resolve()
    paths = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    paths.pop(MANIFEST, None)
    sizes = {rel: (p.stat().st_size, sha256_file(p)) for rel, p in paths.items()}
    # a Core ML package is a folder: its Manifest.json stands for it in the hashes, as in the standard exporter
    stand_in = main if main in sizes else f"{main}/Manifest.json"
    if stand_in not in sizes:
        raise ExportError(f"{folder}: the artifact's main file {main} was not written")
    return {
        "target": target,
        "file": main,
        "files": {rel: {"bytes": n, "sha256": sha} for rel, (n, sha) in sizes.items()},
        "model": {
            "name": model_dir.name,
            "path": str(model_dir),
            "model_type": model_type,
            "weights_sha256": {**weights_sha256(model_dir)},
        },
        "artifact": {"bytes": sum(n for n, _ in sizes.values()), "sha256": sizes[stand_in][1]},
    }


def read_manifest(artifact_dir: Path) -> Manifest:
    """The manifest of an export folder.

    Raises:
        ExportError: the folder has no manifest.json, it is not valid JSON, or it lacks a manifest's fields.
    """
    path = Path(artifact_dir) / MANIFEST
    if not path.is_file():
        raise ExportError(f"{artifact_dir}: no {MANIFEST}; not a moetool export")
    return Manifest.of(read_json(path, what="export manifest", error=ExportError), source=str(path))
