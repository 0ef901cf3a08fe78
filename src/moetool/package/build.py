"""``moetool package``: a merged or tuned model, its exports and its evaluation → one folder laid out for the Hub.

The card says only what the files in the folder back: every artifact is checked against its manifest (size and
sha256) and against the packaged weights (the manifest's ``weights_sha256``) before it is listed.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from moetool.io.atomic import atomic_dir
from moetool.io.safe import read_json
from moetool.package.card import render_card
from moetool.package.inputs import (
    Artifact,
    Inputs,
    PackageError,
    check_contained,
    model_files,
    read_eval,
    resolve_inputs,
    text_of,
)
from moetool.recipe.kept import KEPT_RECIPE

__all__ = ["PackageError", "build_repo"]


def _copy(src: Path, dst: Path, chunk: int = 1 << 22) -> str:
    """Copy ``src`` to ``dst`` and return its sha256, reading the data once."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(chunk):
            h.update(block)
            fout.write(block)
    shutil.copystat(src, dst)
    return h.hexdigest()


def _check_artifact(art: Artifact, weights: dict[str, str], model: Path, shas: dict[str, str]) -> None:
    """Refuse an artifact that changed since export, or that was exported from other weights than the packaged ones."""
    for rel, want in art.files().items():
        if shas.get(rel) != want:
            raise PackageError(f"{art.dir / rel}: sha256 differs from its manifest; it changed since export")
    recorded = art.manifest.weights_sha256
    if recorded != weights:
        differ = sorted(n for n in set(recorded) | set(weights) if recorded.get(n) != weights.get(n))
        raise PackageError(
            f"{art.dir}: exported from other weights than {model} ({', '.join(differ)} differ); "
            "re-export this model or package the model the artifact came from"
        )


def build_repo(
    source: Path,
    output: Path,
    *,
    artifacts: list[Path] | None = None,
    eval_json: Path | None = None,
    plots: Path | None = None,
    force: bool = False,
) -> Path:
    """Write a Hub-ready folder: weights, config, tokenizer, provenance, artifacts, evaluation and a model card.

    Args:
        source: a model directory (``moetool merge``/``train`` output) or a run directory like ``out/demo``
            (``merged/``, ``tuned-*/``, ``eval.json``, ``plots/``, ``exports/*/``).
        output: the folder to write, atomically.
        artifacts: export directories (default for a run directory: every ``exports/*/`` with a manifest).
        eval_json: a ``moetool eval --json`` report (default for a run directory: its ``eval.json``).
        plots: a directory of PNG plots (default for a run directory: its ``plots/``).
        force: replace an existing ``output``.

    Raises:
        PackageError: a file is missing, an artifact does not match its manifest or the packaged weights.
        OutputExistsError: ``output`` exists and ``force`` is false.
    """
    inp = resolve_inputs(source, list(artifacts or []), eval_json, plots)
    _check_destinations(inp, Path(source), Path(output))
    weight_files, other_files = model_files(inp.model)
    report = read_eval(inp.eval_json) if inp.eval_json else None
    if inp.plots and not inp.plots.is_dir():
        raise PackageError(f"{inp.plots}: no such plots directory")
    pngs = sorted(inp.plots.glob("*.png")) if inp.plots else []
    if inp.plots:
        check_contained(pngs, inp.plots)

    with atomic_dir(Path(output), force=force) as tmp:
        # by path relative to the model: a bundle's weights lie in its members' folders (pathways/<name>/)
        rel = {f: f.relative_to(inp.model).as_posix() for f in [*weight_files, *other_files]}
        weights = {rel[f]: _copy(f, tmp / rel[f]) for f in weight_files}
        for f in other_files:
            (tmp / rel[f]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, tmp / rel[f])
        for a in inp.artifacts:
            _copy_artifact(a, tmp / a.repo_dir, weights, inp.model)
        if inp.eval_json:
            _copy(inp.eval_json, tmp / "eval" / "eval.json")
        for p in pngs:
            _copy(p, tmp / "eval" / "plots" / p.name)
        card = render_card(
            meta=read_json(inp.model / "moetool.json", what="moetool metadata", error=PackageError),
            model=inp.model,
            recipe=text_of(inp.model / KEPT_RECIPE),  # shown in the card as written
            train_recipe=text_of(inp.model / "moetool-train-recipe.yaml"),
            artifacts=inp.artifacts,
            report=report,
            plots=[f"eval/plots/{p.name}" for p in pngs],
            same_run=inp.eval_json is not None and inp.eval_json.resolve().parent == inp.model.parent,
        )
        (tmp / "README.md").write_text(card, encoding="utf-8")
    return Path(output)


def _check_destinations(inp: Inputs, source: Path, output: Path) -> None:
    """Refuse an output folder that would swallow a source, and two artifacts that would land in one folder."""
    target = output.resolve()
    read = [inp.model, *(a.dir.resolve() for a in inp.artifacts)]
    read += [p.resolve() for p in (inp.eval_json, inp.plots) if p is not None]
    for src in (source.resolve(), *read):
        if target == src or target in src.parents:  # --force would delete what is being packaged
            raise PackageError(f"--output {output} would replace {src}, which is being packaged; pick another folder")
    for src in read:  # a run directory may hold its repo folder; a model, an artifact or a plots folder may not
        if src in target.parents:
            raise PackageError(f"--output {output} lies inside {src}, which is being packaged; pick another folder")
    seen: dict[str, Path] = {}
    for a in inp.artifacts:
        if a.repo_dir in seen:
            raise PackageError(f"{a.dir} and {seen[a.repo_dir]} would both go to {a.repo_dir}/; rename one")
        seen[a.repo_dir] = a.dir


def _copy_artifact(art: Artifact, dest: Path, weights: dict[str, str], model: Path) -> None:
    """Copy an artifact's files and manifest to ``dest``; the hashes taken while copying are the ones checked, so a
    file that changes during the copy cannot slip through."""
    check_contained([art.dir / rel for rel in art.files()], art.dir)
    shas = {rel: _copy(art.dir / rel, dest / rel) for rel in art.files()}
    _check_artifact(art, weights, model, shas)
    shutil.copy2(art.dir / "manifest.json", dest / "manifest.json")
