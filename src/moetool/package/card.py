"""The packaged folder's README.md: Hub front matter and a body that says only what the folder's files back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetool.arch.records import model_record
from moetool.card import limits_section
from moetool.export.heldout import held_out_text
from moetool.export.parity import parity_of
from moetool.export.parity_text import describe
from moetool.io.files import BUNDLE_LAYOUT
from moetool.io.jsontypes import JsonValue
from moetool.io.safe import read_json
from moetool.package.consumers import consumer_matrix, consumers_section
from moetool.package.inputs import REPO_ID_PLACEHOLDER, Artifact
from moetool.package.runners import runner_rows, runners_section


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _fence(text: str, lang: str) -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}\n"


def front_matter(
    meta: dict[str, Any],
    artifacts: list[Artifact],
    task_scores: dict[str, dict[str, float]] | None = None,
) -> str:
    """YAML the Hub reads. Only Hub repo ids go into ``base_model``: zoo and local sources are not on the Hub.

    ``task_scores`` (the packaged model's lm-eval scores: task → metric → value) become the ``model-index`` results
    the Hub shows. No license is claimed: a recipe has no license key, and the sources' licenses are their own.
    """
    from huggingface_hub import ModelCardData

    sources = meta.get("provenance", {}).get("sources", {})
    hub = list(dict.fromkeys(s["ref"] for s in sources.values() if s.get("kind") == "hf-cache"))
    tags = ["moe", "moetool", "merge", meta.get("method"), meta.get("architecture")]
    if any(a.target == "gguf" for a in artifacts):
        tags += ["gguf", "llama-cpp"]
    data = ModelCardData(
        base_model=hub or None,
        base_model_relation="merge" if hub else None,
        library_name=None if meta.get("layout") == BUNDLE_LAYOUT else "transformers",  # a bundle is no one model
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(t for t in tags if t)),
        model_name=(meta.get("name") or "model") if task_scores else None,
        eval_results=_eval_results(task_scores) if task_scores else None,
    )
    return f"---\n{data.to_yaml()}\n---\n"


def _eval_results(scores: dict[str, dict[str, float]]) -> list[Any]:
    """One Hub ``EvalResult`` per task and metric (the stderr rides along as ``metric_verified=False`` data only)."""
    from huggingface_hub import EvalResult

    results = []
    for task, row in scores.items():
        for metric in ("acc", "acc_norm", "exact_match", "f1", "mcc"):
            if metric in row:
                results.append(
                    EvalResult(
                        task_type="text-generation",
                        dataset_type=task,
                        dataset_name=task,
                        metric_type=metric,
                        metric_value=round(float(row[metric]), 4),
                        source_name="lm-evaluation-harness",
                        source_url="https://github.com/EleutherAI/lm-evaluation-harness",
                    )
                )
    return results


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
    if report.get("tasks"):
        text += _tasks_table(report, this)
    if this is None:
        text += "The packaged model itself is not among the evaluated models.\n\n"
    for p in plots:
        text += f"![{Path(p).stem}]({p})\n\n"
    return text


def _tasks_table(report: dict[str, Any], this: str | None) -> str:
    settings = report.get("settings", {}).get("tasks", {})
    names = settings.get("names") or sorted({t for r in report["tasks"].values() for t in r})
    rows = []
    for m, row in report["tasks"].items():
        cells = [
            f"{row[t]['acc']:.3f} ± {row[t].get('acc_stderr', 0):.3f}" if "acc" in row.get(t, {}) else "–"
            for t in names
        ]
        rows.append(f"| {f'**{m}** (this model)' if m == this else m} | " + " | ".join(cells) + " |")
    how = f"{settings.get('num_fewshot') or 0}-shot" + (
        f", first {settings['limit']} documents" if settings.get("limit") else ""
    )
    return (
        f"Task accuracy with lm-evaluation-harness ({how}; ± standard error):\n\n"
        f"| model | {' | '.join(names)} |\n|---|{'---:|' * len(names)}\n" + "\n".join(rows) + "\n\n"
    )


def _parity(value: JsonValue) -> str:
    """A manifest's ``parity`` in a table cell: the verdict with its tolerance or gate, then the figures."""
    return describe(parity_of(value))


def _artifacts_section(artifacts: list[Artifact]) -> str:
    rows, notes = [], []
    for a in artifacts:
        m = a.manifest
        plan = m.part("plan")
        bpw = plan.get("bits_per_weight")
        label = plan.get("label") or m.get("quant") or ""  # a method's own export names its precision itself
        rows.append(
            f"| {a.target} | `{a.repo_dir}/{a.file}` | {label} | {_size(m.artifact_bytes or 0)} | "
            f"{f'{bpw:.2f}' if isinstance(bpw, int | float) and bpw else ''} | {m.get('device') or 'any'} | "
            f"{_parity(m.get('parity'))} |"
        )
        notes += [f"- `{a.repo_dir}`: {n}" for n in m.notes]
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


def _usage_section(artifacts: list[Artifact], transformers: bool = True) -> str:
    """How to run it: in transformers (one model folder; a bundle is no single model), and a GGUF in llama.cpp."""
    if not transformers:
        text = (
            "## Usage\n\nA bundle of models behind a router: see each artifact's `manifest.json` for its runtime.\n\n"
        )
        return text + _gguf_usage(artifacts)
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
    return text + _gguf_usage(artifacts)


def _gguf_usage(artifacts: list[Artifact]) -> str:
    """llama.cpp snippets for the first GGUF file (a bundle's main file is its router graph: no snippet for it)."""
    text = ""
    gguf = next((a for a in artifacts if a.target == "gguf" and a.file.endswith(".gguf")), None)
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


def _intro(meta: dict[str, Any], name: str) -> str:
    """What the model is: a standard MoE's architecture and routing, or the method that built another output."""
    experts = meta.get("experts", [])
    if "architecture" not in meta:  # another method's output (its own class or a bundle): its docs describe it
        method = meta.get("method")
        kind = "A bundle of models behind a router" if meta.get("layout") == BUNDLE_LAYOUT else "A model"
        text = f"# {name}\n\n{kind} built by moetool with `method: {method}` (see moetool's docs/{method}.md).\n\n"
        label, names = ("domains", meta["domains"]) if meta.get("domains") else ("experts", experts)
        listed = [f"`{e}`" for e in names if isinstance(e, str)]
        return text + (f"- {label}: {', '.join(listed)}\n\n" if listed else "")
    return (
        f"# {name}\n\nA Mixture-of-Experts model built by moetool with `method: {meta.get('method')}`: attention, "
        "norms and embeddings come from the base model; each expert's FFN becomes one routed expert.\n\n"
        f"- architecture: `{meta.get('architecture')}`\n"
        f"- experts: {', '.join(f'`{e}`' for e in experts)}"
        + (" plus a shared expert" if meta.get("shared_expert") else "")
        + f"\n- experts per token: {meta.get('experts_per_token')}\n"
        f"- router initialisation: `{meta.get('gate_mode')}`\n\n"
    )


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
    body = _intro(meta, meta.get("name") or model.name) + _sources_section(meta) + _training_section(meta)
    if report is not None:
        body += _eval_section(report, model, plots, same_run)
    elif plots:
        body += "## Plots\n\n" + "".join(f"![{Path(p).stem}]({p})\n\n" for p in plots)
    if artifacts:
        body += _artifacts_section(artifacts) + runners_section(runner_rows(artifacts))
    config = model / "config.json"
    body += _usage_section(artifacts, transformers=config.is_file())
    if config.is_file():
        cfg = read_json(config, what="model config")
        if model_record(cfg.get("model_type")) is not None:  # a model_type mlx-lm and llama.cpp have classes for
            body += consumers_section(consumer_matrix(model, cfg, artifacts, held_out_text(model)[0]))
        body += limits_section(cfg)
    if recipe:
        body += "## Recipe\n\n" + _fence(recipe, "yaml") + "\n"
    if train_recipe:
        body += "## Training recipe\n\n" + _fence(train_recipe, "yaml") + "\n"
    this = _eval_key(report, model, same_run) if report is not None else None
    scores = (report or {}).get("tasks", {}).get(this) if this is not None else None
    return front_matter(meta, artifacts, scores) + "\n" + body.rstrip() + "\n"
