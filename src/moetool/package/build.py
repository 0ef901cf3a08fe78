"""``moetool package``: a merged or tuned model, its exports and its evaluation → one folder laid out for the Hub.

The card says only what the files in the folder back: every artifact is checked against its manifest (size and
sha256) and against the packaged weights (the manifest's ``weights_sha256``) before it is listed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir


class PackageError(MoetoolError):
    """The source cannot be packaged as asked: missing files, or artifacts of another model."""


# what transformers needs besides weights and config; everything else in a model directory stays behind
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", *TOKENIZER_FILES)
MOETOOL_FILES = ("moetool.json", "moetool-recipe.yaml", "moetool-train-recipe.yaml")
RUN_MODELS = ("tuned-mofe", "merged")  # a run directory's model when no artifact names one, best first
REPO_ID_PLACEHOLDER = "<this-repo-id>"  # the card is written before anyone picks the repo id


@dataclass
class Artifact:
    """One ``moetool export`` output directory: an artifact file and its manifest."""

    dir: Path
    manifest: dict[str, Any]

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
        listed = self.manifest.get("files")
        if listed:
            return {str(rel): info.get("sha256") for rel, info in listed.items()}
        return {self.file: self.manifest["artifact"].get("sha256")}


@dataclass
class Inputs:
    model: Path
    artifacts: list[Artifact]
    eval_json: Path | None
    plots: Path | None


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def load_artifact(path: Path) -> Artifact:
    from moetool.export.base import read_manifest

    path = Path(path)
    manifest = read_manifest(path)
    for key in ("target", "file", "model", "artifact"):
        if key not in manifest:
            raise PackageError(f"{path / 'manifest.json'}: no {key!r}; not a moetool export manifest")
    art = Artifact(path, manifest)
    for rel in art.files():
        if not (path / rel).is_file():
            raise PackageError(f"{path}: the manifest names {rel}, which is not there")
    return art


def _pointed_model(art: Artifact, run: Path) -> Path:
    """The model directory an artifact was exported from; a run directory that moved is searched by name."""
    recorded = Path(art.manifest["model"].get("path") or "")
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


def _model_files(model: Path) -> tuple[list[Path], list[Path]]:
    """(weight files, other files to copy) of a model directory."""
    weights = sorted(model.glob("*.safetensors"))
    if not weights:
        raise PackageError(f"{model}: no *.safetensors weights (moetool packages safetensors checkpoints only)")
    index = model / "model.safetensors.index.json"
    if index.is_file():
        missing = sorted(set(json.loads(index.read_text())["weight_map"].values()) - {w.name for w in weights})
        if missing:
            raise PackageError(f"{index}: names shards that are missing: {', '.join(missing)}")
    if not (model / "moetool.json").is_file():
        raise PackageError(f"{model}: no moetool.json; package the output of `moetool merge` or `moetool train`")
    others = [model / n for n in (*MODEL_FILES, *MOETOOL_FILES) if (model / n).is_file()]
    return weights, others


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
    recorded = art.manifest["model"].get("weights_sha256") or {}
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
    target = Path(output).resolve()
    for src in (Path(source).resolve(), inp.model, *(a.dir.resolve() for a in inp.artifacts)):
        if target == src or target in src.parents:  # --force would delete what is being packaged
            raise PackageError(f"--output {output} would replace {src}, which is being packaged; pick another folder")
    weight_files, other_files = _model_files(inp.model)
    seen: dict[str, Path] = {}
    for a in inp.artifacts:
        if a.repo_dir in seen:
            raise PackageError(f"{a.dir} and {seen[a.repo_dir]} would both go to {a.repo_dir}/; rename one")
        seen[a.repo_dir] = a.dir
    report = _read_eval(inp.eval_json) if inp.eval_json else None
    if inp.plots and not inp.plots.is_dir():
        raise PackageError(f"{inp.plots}: no such plots directory")
    pngs = sorted(inp.plots.glob("*.png")) if inp.plots else []

    with atomic_dir(Path(output), force=force) as tmp:
        weights = {f.name: _copy(f, tmp / f.name) for f in weight_files}
        for f in other_files:
            shutil.copy2(f, tmp / f.name)
        for a in inp.artifacts:
            dest = tmp / a.repo_dir
            shas = {rel: _copy(a.dir / rel, dest / rel) for rel in a.files()}
            _check_artifact(a, weights, inp.model, shas)
            shutil.copy2(a.dir / "manifest.json", dest / "manifest.json")
        if inp.eval_json:
            _copy(inp.eval_json, tmp / "eval" / "eval.json")
        for p in pngs:
            _copy(p, tmp / "eval" / "plots" / p.name)
        card = render_card(
            meta=json.loads((inp.model / "moetool.json").read_text(encoding="utf-8")),
            model=inp.model,
            recipe=_text(inp.model / "moetool-recipe.yaml"),
            train_recipe=_text(inp.model / "moetool-train-recipe.yaml"),
            artifacts=inp.artifacts,
            report=report,
            plots=[f"eval/plots/{p.name}" for p in pngs],
            same_run=inp.eval_json is not None and inp.eval_json.resolve().parent == inp.model.parent,
        )
        (tmp / "README.md").write_text(card, encoding="utf-8")
    return Path(output)


def _text(path: Path) -> str | None:
    return path.read_text(encoding="utf-8") if path.is_file() else None


def _read_eval(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise PackageError(f"{path}: no such evaluation report")
    try:
        report: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PackageError(f"{path}: not JSON ({exc})") from None
    if not isinstance(report, dict) or not {"domains", "perplexity"} <= set(report):
        raise PackageError(f"{path}: not a `moetool eval --json` report (no domains/perplexity)")
    return report


# ---------------------------------------------------------------------------------------------------- model card


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _fence(text: str, lang: str) -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}\n"


def front_matter(meta: dict[str, Any], artifacts: list[Artifact], recipe: str | None) -> str:
    """YAML the Hub reads. Only Hub repo ids go into ``base_model``: zoo and local sources are not on the Hub."""
    import yaml
    from huggingface_hub import ModelCardData

    sources = meta.get("provenance", {}).get("sources", {})
    hub = list(dict.fromkeys(s["ref"] for s in sources.values() if s.get("kind") == "hf-cache"))
    license_ = (yaml.safe_load(recipe) or {}).get("license") if recipe else None
    tags = ["moe", "moetool", "merge", meta.get("method"), meta.get("architecture")]
    if any(a.target == "gguf" for a in artifacts):
        tags += ["gguf", "llama-cpp"]
    data = ModelCardData(
        base_model=hub or None,
        base_model_relation="merge" if hub else None,
        license=license_ or None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(t for t in tags if t)),
    )
    return f"---\n{data.to_yaml()}\n---\n"


_KINDS = {"zoo": "moetool's self-trained demo models", "local": "directories on the machine that built this model"}


def _sources_section(meta: dict[str, Any]) -> str:
    sources = meta.get("provenance", {}).get("sources", {})
    rows = []
    for label, s in sources.items():
        files = "<br>".join(f"`{name}` `{sha}`" for name, sha in (s.get("files") or {}).items()) or "(not recorded)"
        rev = f" @ `{s['revision'][:12]}`" if s.get("revision") else ""
        rows.append(f"| {label} | `{s.get('ref')}`{rev} | {s.get('kind')} | {files} |")
    text = (
        "## Sources\n\n| role | reference | kind | weight files (sha256) |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
    )
    off_hub = sorted({str(s.get("kind")) for s in sources.values() if s.get("kind") != "hf-cache"})
    if off_hub:
        kinds = "; ".join(f"`{k}`: {_KINDS.get(k, 'not a Hub repository')}" for k in off_hub)
        text += (
            f"Some sources are not Hub repositories ({kinds}), so they are not listed as `base_model`; "
            "the hashes above identify their exact weights.\n\n"
        )
    return text + "Tool versions and source paths are in `moetool.json`.\n\n"


def _training_section(meta: dict[str, Any]) -> str:
    tr = meta.get("training")
    if not tr:
        return ""
    fr = tr.get("freeze", {})
    cfg = tr.get("train", {})
    final = (tr.get("history") or [{}])[-1].get("loss")
    return (
        f"## Router tuning\n\nTuned with `moetool train` for {tr.get('steps')} steps on domains "
        f"{', '.join(cfg.get('data', {}))} with freeze preset `{fr.get('preset')}`: "
        f"{fr.get('trainable_params', 0):,} trainable and {fr.get('frozen_params', 0):,} frozen parameters"
        + (f"; final training loss {final:.4f}" if isinstance(final, int | float) else "")
        + ". The full training configuration and loss history are in `moetool.json`.\n\n"
    )


def _eval_key(report: dict[str, Any], model: Path, same_run: bool) -> str | None:
    """The report's name for the packaged model: same path, else, for a report in the model's own run directory
    (which may have been moved or copied), the same directory name."""
    models = report.get("models", {})
    for key, info in models.items():
        if info.get("path") and Path(info["path"]).resolve() == model:
            return str(key)
    for key, info in models.items() if same_run else ():
        if Path(info.get("path") or key).name == model.name:
            return str(key)
    return None


def _eval_section(report: dict[str, Any], model: Path, plots: list[str], same_run: bool) -> str:
    domains = list(report["domains"])
    this = _eval_key(report, model, same_run)
    settings = report.get("settings", {})
    how = ", ".join(
        f"{k.replace('_', ' ')} {v}"
        for k, v in (("seq_len", settings.get("seq_len")), ("max_tokens", settings.get("max_tokens")))
        if v
    )
    rows = []
    for name, row in report["perplexity"].items():
        cells = [f"{row[d]:.2f}" if d in row else "–" for d in domains]
        mean = sum(row[d] for d in domains if d in row) / max(1, sum(d in row for d in domains))
        label = f"**{name}** (this model)" if name == this else name
        own = report.get("models", {}).get(name, {}).get("own_domain")
        rows.append(f"| {label} | {own or ''} | " + " | ".join(cells) + f" | {mean:.2f} |")
    text = (
        "## Evaluation\n\nHeld-out perplexity per domain (lower is better"
        + (f"; {how}" if how else "")
        + "), from `eval/eval.json`, which also holds routing statistics and GEM metrics.\n\n"
        + f"| model | own domain | {' | '.join(domains)} | mean |\n|---|---|{'---:|' * (len(domains) + 1)}\n"
        + "\n".join(rows)
        + "\n\n"
    )
    if this is None:
        text += "The packaged model itself is not among the evaluated models.\n\n"
    for p in plots:
        text += f"![{Path(p).stem}]({p})\n\n"
    return text


def _parity(p: Any) -> str:
    if not isinstance(p, dict):
        return str(p or "not verified")
    diffs = ", ".join(f"{float(v):.1e} @{k}" for k, v in p.get("max_abs_logit_diff", {}).items())
    parts = [f"max abs Δlogit {diffs} tokens"] if diffs else []
    if "top1_agreement" in p:
        parts.append(f"top-1 agreement {100 * p['top1_agreement']:.2f}%")
    if "ppl_change" in p:
        parts.append(f"perplexity {100 * p['ppl_change']:+.2f}%")
    if "decode" in p:
        parts.append(f"cached decode {float(p['decode']['max_abs_logit_diff']):.1e}")
    if "conversion" in p:
        conv = max(float(v) for v in p["conversion"]["max_abs_logit_diff"].values())
        parts.append(f"conversion alone (artifact's own weights) {conv:.1e}")
    if "tokenizer_match" in p:
        parts.append("tokenizer matches" if p["tokenizer_match"] else "tokenizer DIFFERS")
    text = "; ".join(parts)
    if "core_ml_runtime" in p:  # the figures are the converted torch wrapper's, not Core ML's
        text = (
            f"torch wrapper that was converted (Core ML runs on macOS only; see scripts/coreml_parity_mac.py): {text}"
        )
    return text


def _artifacts_section(artifacts: list[Artifact]) -> str:
    rows, notes = [], []
    for a in artifacts:
        m = a.manifest
        plan = m.get("plan", {})
        bpw = plan.get("bits_per_weight")
        rows.append(
            f"| {a.target} | `{a.repo_dir}/{a.file}` | {plan.get('label', '')} | {_size(m['artifact']['bytes'])} | "
            f"{f'{bpw:.2f}' if bpw else ''} | {m.get('device') or 'any'} | {_parity(m.get('parity'))} |"
        )
        notes += [f"- `{a.repo_dir}`: {n}" for n in m.get("notes", [])]
    return (
        "## On-device artifacts\n\nParity compares each artifact in its runtime with this checkpoint in transformers "
        "(float32) on held-out text. Float plans must meet a gate; quantized plans are reported (a GGUF must also "
        "agree with transformers on its own dequantized weights).\n\n"
        "| target | file | plan | size | bits/weight | device | parity |\n|---|---|---|---:|---:|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
        + ("\n".join(notes) + "\n\n" if notes else "")
        + "Each artifact's `manifest.json` next to it holds the per-tensor plan, memory estimate and hashes.\n\n"
    )


def _usage_section(artifacts: list[Artifact]) -> str:
    text = (
        "## Usage\n\n"
        + _fence(
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'repo = "{REPO_ID_PLACEHOLDER}"\n'
            "tok = AutoTokenizer.from_pretrained(repo)\n"
            "model = AutoModelForCausalLM.from_pretrained(repo)\n"
            'ids = tok("def main():", return_tensors="pt")\n'
            "print(tok.decode(model.generate(**ids, max_new_tokens=32)[0]))",
            "python",
        )
        + "\n"
    )
    gguf = next((a for a in artifacts if a.target == "gguf"), None)
    if gguf is not None:
        path = f"{gguf.repo_dir}/{gguf.file}"
        text += (
            "With llama.cpp, after downloading the GGUF file:\n\n"
            + _fence(f'llama-cli -m {path} -p "def main():" -n 32', "sh")
            + "\nWith llama-cpp-python:\n\n"
            + _fence(
                "from llama_cpp import Llama\n\n"
                f'llm = Llama.from_pretrained(repo_id="{REPO_ID_PLACEHOLDER}", filename="{path}")\n'
                'print(llm("def main():", max_tokens=32)["choices"][0]["text"])',
                "python",
            )
            + "\n"
        )
    return text


def render_card(
    *,
    meta: dict[str, Any],
    model: Path,
    recipe: str | None,
    train_recipe: str | None,
    artifacts: list[Artifact],
    report: dict[str, Any] | None,
    plots: list[str],
    same_run: bool = False,
) -> str:
    """README.md: front matter, what the model is, where it came from, how it scores, what runs on devices.

    ``same_run`` says the report lies in the model's run directory, so its rows may be matched by directory name.
    """
    experts = meta.get("experts", [])
    name = meta.get("name") or model.name
    body = (
        f"# {name}\n\nA Mixture-of-Experts model built by moetool with `method: {meta.get('method')}`: attention, "
        "norms and embeddings come from the base model; each expert's FFN becomes one routed expert.\n\n"
        f"- architecture: `{meta.get('architecture')}`\n"
        f"- experts: {', '.join(f'`{e}`' for e in experts)}"
        + (" plus a shared expert" if meta.get("shared_expert") else "")
        + f"\n- experts per token: {meta.get('experts_per_token')}\n"
        f"- router initialisation: `{meta.get('gate_mode')}`\n\n"
    )
    body += _sources_section(meta) + _training_section(meta)
    if report is not None:
        body += _eval_section(report, model, plots, same_run)
    elif plots:
        body += "## Plots\n\n" + "".join(f"![{Path(p).stem}]({p})\n\n" for p in plots)
    if artifacts:
        body += _artifacts_section(artifacts)
    body += _usage_section(artifacts)
    if recipe:
        body += "## Recipe\n\n" + _fence(recipe, "yaml") + "\n"
    if train_recipe:
        body += "## Training recipe\n\n" + _fence(train_recipe, "yaml") + "\n"
    return front_matter(meta, artifacts, recipe) + "\n" + body.rstrip() + "\n"
