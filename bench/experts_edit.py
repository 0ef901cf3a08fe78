"""`moetool experts` on the real default (the SmolLM2-135M zoo): add, remove and prune against MoEs built at once.

* add:    a 2-expert MoE (code + legal) plus `experts add` medical (prompts, then router-only tuning on all three
          domains) against the 3-expert MoE built at once (merged, then the same tuning), per seed;
* remove: the 3-expert MoE minus medical against the 2-expert MoE built at once (merged; and both tuned);
* prune:  a 4-expert MoE (code, legal, medical and the base as `general`, top-2) pruned to 2 per layer by REAP, by
          routing frequency and at random, each without and with router recalibration.

Every figure is held-out perplexity per domain from `moetool eval` (the zoo's held-out splits, never trained or
calibrated on), with the local lm-eval continuation tasks for add and remove; ratios are against the peer built at
once in the same run. Everything goes under OUT (kept, so any model can be inspected) and OUT/results.json.

Run:  .venv/bin/python bench/experts_edit.py -o out/experts-bench [--seeds 0,1,2] [--steps 60] [--only add,remove,prune]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from moetool import api
from moetool.edit.tune import Recalibration, recalibrate
from moetool.io.sources import resolve_source

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ["code", "legal", "medical"]
DATA = {d: f"zoo:smollm2-{d}" for d in DOMAINS}
GENERAL = {
    "name": "general",
    "source": "zoo:smollm2-base",
    "positive_prompts": [
        "What is the capital of France?",
        "Once upon a time there was a little girl who lived in a village near the forest.",
        "The weather today is sunny with a light breeze from the west.",
        "Write a short poem about the sea.",
    ],
}


def recipe(out: Path, name: str, experts: list[str], *, general: bool = False, seed: int = 0, steps: int = 60) -> Path:
    """A copy of recipes/real-mofe.yaml with only ``experts`` (and the base as `general`), router-only tuning."""
    doc = yaml.safe_load((ROOT / "recipes" / "real-mofe.yaml").read_text())
    doc["name"] = name
    doc["experts"] = [e for e in doc["experts"] if e["name"] in experts] + ([GENERAL] if general else [])
    doc["freeze"] = {"preset": "router_only"}
    doc["train"] |= {"steps": steps, "seed": seed, "checkpoint_every": steps, "learning_rate": 0.05}
    doc.pop("targets", None)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def merged(out: Path, name: str, experts: list[str], **kw: Any) -> Path:
    target = out / name
    if not (target / "config.json").is_file():
        api.assemble(api.load(recipe(out, name, experts, **kw)), target, force=True)
    return target


def tuned(out: Path, model: Path, name: str, experts: list[str], seed: int, steps: int, **kw: Any) -> Path:
    target = out / f"{name}-tuned-s{seed}"
    if not (target / "config.json").is_file():
        r = api.load(recipe(out, f"{name}-s{seed}", experts, seed=seed, steps=steps, **kw))
        api.train(r, target, model=model, force=True)
    return target


def evaluate(
    models: dict[str, Path], max_tokens: int, with_tasks: tuple[str, ...] = (), limit: int = 30
) -> dict[str, dict[str, float]]:
    """Held-out perplexity per domain for every model; the local continuation tasks (``limit`` items each, lm-eval
    on 2 CPU cores costs minutes per model) for the labels in ``with_tasks``."""
    report = api.evaluate([str(p) for p in models.values()], domains=DOMAINS, max_tokens=max_tokens)
    rows = {label: dict(report["perplexity"][str(path)]) for label, path in models.items()}
    chosen = [models[label] for label in with_tasks]
    if chosen:
        scored = api.evaluate([str(p) for p in chosen], domains=DOMAINS, max_tokens=256, tasks=["local"], limit=limit)
        for label in with_tasks:
            for task, score in scored["tasks"][str(models[label])].items():
                rows[label][f"task:{task}"] = next(iter(score.values())) if isinstance(score, dict) else score
    return rows


def tune_settings(seed: int, steps: int) -> Recalibration:
    return Recalibration(steps=steps, router_learning_rate=0.05, seed=seed)


def bench_add(out: Path, seeds: list[int], steps: int, max_tokens: int) -> dict[str, Any]:
    two = merged(out, "code-legal", ["code", "legal"])
    three = merged(out, "code-legal-medical", DOMAINS)
    prompts = next(
        e for e in yaml.safe_load((ROOT / "recipes/real-mofe.yaml").read_text())["experts"] if e["name"] == "medical"
    )
    models: dict[str, Path] = {}
    for seed in seeds:
        added = out / f"added-medical-s{seed}"
        if not (added / "config.json").is_file():
            src = resolve_source("zoo:smollm2-medical").path
            api.experts.add(
                two,
                src,
                added,
                name="medical",
                prompts=prompts["positive_prompts"],
                chat_template=True,
                tune=tune_settings(seed, steps),
                data=DATA,
                force=True,
            )
        models[f"add s{seed}"] = added
        models[f"at once s{seed}"] = tuned(out, three, "code-legal-medical", DOMAINS, seed, steps)
    rows = evaluate(models, max_tokens, (f"add s{seeds[0]}", f"at once s{seeds[0]}"))
    return {"rows": rows, "ratios": ratios(rows, "add", "at once", seeds)}


def bench_remove(out: Path, seeds: list[int], steps: int, max_tokens: int) -> dict[str, Any]:
    two = merged(out, "code-legal", ["code", "legal"])
    three = merged(out, "code-legal-medical", DOMAINS)
    models = {"remove merged": out / "removed-medical", "at once merged": two}
    if not (models["remove merged"] / "config.json").is_file():
        api.experts.remove(three, ["medical"], models["remove merged"], force=True)
    for seed in seeds:
        src = tuned(out, three, "code-legal-medical", DOMAINS, seed, steps)
        target = out / f"removed-medical-tuned-s{seed}"
        if not (target / "config.json").is_file():
            api.experts.remove(src, ["medical"], target, force=True)
        models[f"remove tuned s{seed}"] = target
        models[f"at once tuned s{seed}"] = tuned(out, two, "code-legal", ["code", "legal"], seed, steps)
    rows = evaluate(models, max_tokens)
    return {
        "bitwise_equal_merged": same_tensors(models["remove merged"], two),
        "rows": rows,
        "ratios_merged": ratios(rows, "remove merged", "at once merged", None),
        "ratios_tuned": ratios(rows, "remove tuned", "at once tuned", seeds),
    }


def bench_prune(out: Path, seeds: list[int], steps: int, max_tokens: int) -> dict[str, Any]:
    four = merged(out, "four", DOMAINS, general=True)
    models: dict[str, Path] = {"4 experts": four}
    # every criterion over the whole MoE (with and without recalibration), and REAP per layer as its paper prunes
    for by, per_layer in (("reap", False), ("frequency", False), ("random", False), ("reap", True)):
        label = f"{by}{' per-layer' if per_layer else ''}"
        target = out / f"pruned-{by}{'-pl' if per_layer else ''}"
        if not (target / "config.json").is_file():
            api.experts.prune(four, target, keep=2, by=by, data=DATA, per_layer=per_layer, force=True)
        models[label] = target
        for seed in seeds if not per_layer else []:
            # the pruned model is the same for every seed (the scores do not depend on it): recalibrate it, as
            # `experts prune --tune-steps` does after its edit, without scoring and checking it again
            rt = out / f"pruned-{by}{'-pl' if per_layer else ''}-recal-s{seed}"
            if not (rt / "config.json").is_file():
                recalibrate(target, rt, DATA, tune_settings(seed, steps), name=target.name, force=True)
            models[f"{label} + recal s{seed}"] = rt
    rows = evaluate(models, max_tokens // 2)
    kept = {
        label: json.loads((p / "moetool.json").read_text())["edits"][-1].get("layers", [])[:1]
        for label, p in models.items()
        if label != "4 experts"
    }
    return {"rows": rows, "kept_layer0": kept, "sizes_mb": {k: size_mb(p) for k, p in models.items()}}


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two folders hold the same tensors, bit for bit."""
    import torch

    from moetool.io.checkpoint import Checkpoint

    ca, cb = Checkpoint(a), Checkpoint(b)
    return set(ca.tensors) == set(cb.tensors) and all(torch.equal(ca.get(n), cb.get(n)) for n in ca.tensors)


def size_mb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6, 1)


def ratios(rows: dict[str, dict[str, float]], a: str, b: str, seeds: list[int] | None) -> dict[str, Any]:
    """Per domain (and task): mean and spread over seeds of (a / b − 1) for perplexity, (a − b) for task scores."""
    out: dict[str, Any] = {}
    pairs = [(f"{a} s{s}", f"{b} s{s}") for s in seeds] if seeds else [(a, b)]
    for key in [k for k in rows[pairs[0][0]] if all(k in rows[x] and k in rows[y] for x, y in pairs)]:
        vals = [
            (rows[x][key] / rows[y][key] - 1) if not key.startswith("task:") else rows[x][key] - rows[y][key]
            for x, y in pairs
        ]
        out[key] = {"mean": statistics.mean(vals), "spread": (max(vals) - min(vals)) / 2, "values": vals}
    return out


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def tables(results: dict[str, Any]) -> str:
    """The README's markdown tables from results.json."""
    lines: list[str] = []
    for part, a, b in (("add", "add", "at once"), ("remove", "remove tuned", "at once tuned")):
        if part not in results:
            continue
        res = results[part]
        ratio = res["ratios"] if part == "add" else res["ratios_tuned"]
        rows = res["rows"]
        lines += [
            f"\n**{part}** ({a} against {b}, mean ± half-range over seeds)\n",
            "| | " + " | ".join(DOMAINS) + " |",
        ]
        lines.append("|---" * (len(DOMAINS) + 1) + "|")
        for label in rows:
            lines.append(f"| {label} | " + " | ".join(f"{rows[label][d]:.3f}" for d in DOMAINS) + " |")
        lines.append(
            f"| **{a} / {b} − 1** | "
            + " | ".join(f"{_pct(ratio[d]['mean'])} ± {100 * ratio[d]['spread']:.1f}" for d in DOMAINS)
            + " |"
        )
        if part == "remove":
            merged = res["ratios_merged"]
            lines.append(
                "| **remove merged / at once merged − 1** | "
                + " | ".join(_pct(merged[d]["mean"]) for d in DOMAINS)
                + " |"
            )
        tasks = sorted({k for r in rows.values() for k in r if k.startswith("task:")})
        for task in tasks:
            got = {label: r[task] for label, r in rows.items() if task in r}
            lines.append(f"\n{task[5:]}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()))
    if "prune" in results:
        res = results["prune"]
        lines += ["\n**prune** 4 → 2 experts per layer (held-out perplexity; size of the safetensors)\n"]
        lines += ["| model | size | " + " | ".join(DOMAINS) + " |", "|---" * (len(DOMAINS) + 2) + "|"]
        groups: dict[str, list[str]] = {}
        for label in res["rows"]:
            groups.setdefault(label.split(" s")[0] if " + recal s" in label else label, []).append(label)
        for group, labels in groups.items():
            vals = {d: [res["rows"][x][d] for x in labels] for d in DOMAINS}
            cells = [
                f"{statistics.mean(v):.3f}" + (f" ± {(max(v) - min(v)) / 2:.3f}" if len(v) > 1 else "")
                for v in vals.values()
            ]
            lines.append(f"| {group} | {res['sizes_mb'][labels[0]]:.0f} MB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--only", default="add,remove,prune")
    ap.add_argument(
        "--remove-seeds", default="0", help="seeds of the tuned remove comparison (each tunes a 2-expert MoE)"
    )
    ap.add_argument("--prune-steps", type=int, default=20, help="recalibration steps after pruning")
    ap.add_argument("--prune-seeds", default=None, help="recalibration seeds after pruning (default: --seeds)")
    ap.add_argument("--tables", action="store_true", help="print the README tables from OUT/results.json and stop")
    args = ap.parse_args()
    if args.tables:
        print(tables(json.loads((args.out / "results.json").read_text())))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    for part in args.only.split(","):
        t0 = time.perf_counter()
        part_seeds = {"remove": args.remove_seeds, "prune": args.prune_seeds or args.seeds}.get(part, args.seeds)
        part_seeds = [int(s) for s in part_seeds.split(",")]
        steps = args.prune_steps if part == "prune" else args.steps
        results[part] = {"add": bench_add, "remove": bench_remove, "prune": bench_prune}[part](
            args.out, part_seeds, steps, args.max_tokens
        )
        results[part]["seconds"] = round(time.perf_counter() - t0)
        results_file.write_text(json.dumps(results, indent=2))
        print(json.dumps({part: results[part]}, indent=2))


if __name__ == "__main__":
    main()
