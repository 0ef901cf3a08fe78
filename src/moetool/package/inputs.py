"""What ``moetool package`` reads: the model directory, its export artifacts (manifests), the evaluation report.

Nothing here reads more than JSON and file listings; hashes are checked while copying (:mod:`moetool.package.build`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetool.errors import MoetoolError
from moetool.export.base import Manifest, read_manifest
from moetool.io.files import TOKENIZER_FILES, is_bundle, weight_files
from moetool.io.safe import decode_utf8, read_bytes, read_json
from moetool.recipe.kept import KEPT_RECIPE


class PackageError(MoetoolError):
    """The source cannot be packaged as asked: missing files, or artifacts of another model."""


# what transformers needs besides the weights; everything else in a model directory stays behind
MODEL_FILES = ("config.json", "model.safetensors.index.json", *TOKENIZER_FILES)
MOETOOL_FILES = ("moetool.json", KEPT_RECIPE, "moetool-train-recipe.yaml")
RUN_MODELS = ("tuned-mofe", "merged")  # a run directory's model when no artifact names one, best first
REPO_ID_PLACEHOLDER = "<this-repo-id>"  # the card is written before anyone picks the repo id


@dataclass
class Artifact:
    """One ``moetool export`` output directory: an artifact file and its manifest."""

    dir: Path
    manifest: Manifest

    @property
    def target(self) -> str:
        return str(self.manifest["target"])

    @property
    def file(self) -> str:
        return str(self.manifest["file"])

    @property
    def repo_dir(self) -> str:
        return f"{self.target}/{self.dir.name}"

    def files(self) -> dict[str, str | None]:
        """Every file of the artifact (relative path → sha256 from the manifest): graph targets list several
        (ONNX's two graphs, a Core ML package's contents), GGUF has one."""
        return self.manifest.file_hashes


@dataclass
class Inputs:
    model: Path
    artifacts: list[Artifact]
    eval_json: Path | None
    plots: Path | None


def is_model_dir(path: Path) -> bool:
    """Whether ``path`` is what a repo folder packages: one transformers model (its config.json) or a method bundle
    (GEM's sequence level, hybrid: ``moetool.json`` says so), packaged whole."""
    return (path / "config.json").is_file() or is_bundle(path)


def load_artifact(path: Path) -> Artifact:

    path = Path(path)
    manifest = read_manifest(path)
    for key in ("target", "file", "model", "artifact"):
        if key not in manifest:
            raise PackageError(f"{path / 'manifest.json'}: no {key!r}; not a moetool export manifest")
    if not isinstance(manifest["model"], dict):
        raise PackageError(f"{path / 'manifest.json'}: model: not a JSON object; not a moetool export manifest")
    art = Artifact(path, manifest)
    for rel in art.files():
        if not (path / rel).is_file():
            raise PackageError(f"{path}: the manifest names {rel}, which is not there")
    return art


def _pointed_model(art: Artifact, run: Path) -> Path:
    """The model directory an artifact was exported from; a run directory that moved is searched by name."""
    recorded = Path(art.manifest.model_path or "")
    for candidate in (recorded, run / recorded.name):
        if str(candidate) not in ("", ".") and is_model_dir(candidate):
            return candidate.resolve()
    raise PackageError(
        f"{art.dir}: exported from {recorded}, which is gone (and {run / recorded.name} is no model directory); "
        "package that model directory with --artifact instead"
    )


def resolve_inputs(source: Path, artifacts: list[Path], eval_json: Path | None, plots: Path | None) -> Inputs:
    """Decide which model, artifacts, evaluation and plots go into the package (nothing is read beyond JSON)."""
    source = Path(source)
    eval_json = Path(eval_json) if eval_json is not None else None
    plots = Path(plots) if plots is not None else None
    if not source.is_dir():
        raise PackageError(f"{source}: no such directory")
    arts = [load_artifact(Path(a)) for a in artifacts]
    if is_model_dir(source):
        return Inputs(source.resolve(), arts, eval_json, plots)
    if not artifacts:
        arts = [load_artifact(m.parent) for m in sorted(source.glob("exports/*/manifest.json"))]
    pointed: dict[Path, list[str]] = {}
    for a in arts:
        pointed.setdefault(_pointed_model(a, source), []).append(a.dir.name)
    if len(pointed) > 1:
        which = "; ".join(f"{', '.join(names)} from {path}" for path, names in pointed.items())
        raise PackageError(f"{source}: the artifacts come from different models ({which}); pick one with --artifact")
    model = next(iter(pointed), None)
    if model is None:
        model = next((source / n for n in RUN_MODELS if is_model_dir(source / n)), None)
    if model is None:
        raise PackageError(
            f"{source}: neither a model directory (no config.json) nor a moetool run directory "
            f"(no exports/*/manifest.json, no {' or '.join(RUN_MODELS)}/)"
        )
    if eval_json is None and (source / "eval.json").is_file():
        eval_json = source / "eval.json"
    if plots is None and (source / "plots").is_dir():
        plots = source / "plots"
    return Inputs(model.resolve(), arts, eval_json, plots)


def model_files(model: Path) -> tuple[list[Path], list[Path]]:
    """(weight files, other files to copy) of a model directory; of a bundle, every file in its tree (the weights:
    :func:`moetool.io.files.weight_files`, the same files an export's manifest records)."""
    weights = weight_files(model)
    if not weights:
        raise PackageError(f"{model}: no *.safetensors weights (moetool packages safetensors checkpoints only)")
    if is_bundle(model):
        others = sorted(f for f in model.rglob("*") if f.is_file() and f not in weights)
        check_contained([*weights, *others], model)
        return weights, others
    index = model / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, what="safetensors index", error=PackageError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise PackageError(f"{index}: weight_map: missing or not a JSON object")
        missing = sorted({str(v) for v in weight_map.values()} - {w.name for w in weights})
        if missing:
            raise PackageError(f"{index}: names shards that are missing: {', '.join(missing)}")
    if not (model / "moetool.json").is_file():
        raise PackageError(f"{model}: no moetool.json; package the output of `moetool merge` or `moetool train`")
    others = [model / n for n in (*MODEL_FILES, *MOETOOL_FILES) if (model / n).is_file()]
    check_contained([*weights, *others], model)
    return weights, others


def check_contained(files: list[Path], folder: Path) -> None:
    """Refuse a file that is a link resolving outside ``folder``: packaging copies what it points to, and a link to a
    secrets file would be published as a plain file. A Hugging Face cache snapshot's links into its repo's
    ``blobs/`` are allowed.

    Raises:
        PackageError: naming the link and where it points.
    """
    root = Path(folder).resolve()
    roots = [root, root.parent.parent] if root.parent.name == "snapshots" else [root]
    for f in files:
        target = Path(f).resolve()
        if not any(target.is_relative_to(r) for r in roots):
            raise PackageError(
                f"{f} is a link to {target}, outside {root}; packaging would publish that file. Copy the real "
                "file into the model folder if it belongs there"
            )


def text_of(path: Path) -> str | None:
    """A text file of the model directory (a recipe), UTF-8 checked, or None when there is none."""
    if not path.is_file():
        return None
    return decode_utf8(read_bytes(path, what=path.name, error=PackageError), path, what=path.name, error=PackageError)


def read_eval(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise PackageError(f"{path}: no such evaluation report")
    report: dict[str, Any] = read_json(path, what="evaluation report", error=PackageError)
    if not {"domains", "perplexity"} <= set(report):
        raise PackageError(f"{path}: not a `moetool eval --json` report (no domains/perplexity)")
    return report
