"""CoMiGS claim check on the demo zoo: per-user test perplexity for Local, FedAvg, CoMiGS-2S, -2G, -1G1S (the
paper's Table 2 rows) plus the recipe's heterogeneous 1GXS and, optionally, routers trained on the train split (-tr).

Users and schedule come from recipes/demo-comigs.yaml (4 users: code, legal, medical, and a data-poor legal-small
with 4k training tokens; 6 rounds x 8 iterations, batch 8x128, tau 16, s 4). Every method gets the same data, the
same seeds and the same LoRA budget (two LoRA MLP experts per user, rank 8, plus shared attention LoRA), in one
process on one CPU thread. Also reports train-split perplexity, so overfitting shows as a train/test gap.

Run:  .venv/bin/python bench/comigs_experiment.py [--out out/bench/comigs] [--rounds 8] [--tr] [--seed 1]

--seed N sets both the recipe's seeds (lora.seed: LoRA factors; training.seed: batch sampling) to N; the data split
does not depend on it, so every seed sees the same train and test tokens. Seed 0 is the recipes' default.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from moetool.methods.comigs.federated import prepare, run_inprocess, variant_recipe
from moetool.recipe import load_recipe
from moetool.recipe.comigs import ComigsRecipe

ROOT = Path(__file__).resolve().parents[1]


def one_g_one_s(r: ComigsRecipe) -> ComigsRecipe:
    """Every user with the generalist and exactly one specialist (the paper's homogeneous CoMiGS-1G1S)."""
    users = [u.model_copy(update={"specialists": u.specialists[:1]}) for u in r.users]
    return r.model_copy(update={"users": users})


def with_seed(r: ComigsRecipe, seed: int) -> ComigsRecipe:
    """The recipe with LoRA initialisation and batch sampling both seeded by ``seed``."""
    return r.model_copy(
        update={
            "lora": r.lora.model_copy(update={"seed": seed}),
            "training": r.training.model_copy(update={"seed": seed}),
        }
    )


@torch.inference_mode()
def generalist_share(c: Any) -> dict[str, list[float]]:
    """Mean routing weight of expert 0 (the generalist under CoMiGS) per layer on 2k test tokens (paper Fig. 3)."""
    from moetool.methods.comigs.model import route

    if not c.router_names or c.model.config.n_generalists != 1:
        return {}
    c.model.eval()
    body = c.cfg.seq_len - 1
    ids = c.data.test[: 16 * body].reshape(16, body)
    ids = torch.cat([torch.full((16, 1), c.bos_id if c.bos_id is not None else 0), ids], dim=1)
    c.model(input_ids=ids)
    out = []
    for logits in c.model.router_logits():
        w, idx = route(logits, c.model.config.experts_per_token)
        out.append(float((w * (idx == 0)).sum(-1).mean()))
    return {"generalist_weight_per_layer": out}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "demo-comigs.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench" / "comigs")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--tr", action="store_true", help="Also run CoMiGS-1G1S-tr (routers on the train split).")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="Test tokens per user (train: 4096).")
    ap.add_argument("--variants", default="", help="Comma-separated subset of the runs (e.g. CoMiGS-2S,CoMiGS-1G1S).")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is an idle core's time).")
    ap.add_argument("--seed", type=int, default=None, help="Set lora.seed and training.seed (default: the recipe's).")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe)
    assert isinstance(recipe, ComigsRecipe)
    if args.seed is not None:
        recipe = with_seed(recipe, args.seed)
    if args.rounds:
        recipe = recipe.model_copy(update={"training": recipe.training.model_copy(update={"rounds": args.rounds})})
    base_1g1s = one_g_one_s(recipe)
    runs = {
        "Local": variant_recipe(base_1g1s, "local"),
        "FedAvg": variant_recipe(base_1g1s, "fedavg"),
        "CoMiGS-2S": variant_recipe(base_1g1s, "2S"),
        "CoMiGS-2G": variant_recipe(base_1g1s, "2G"),
        "CoMiGS-1G1S": base_1g1s,
        "CoMiGS-1GXS (recipe)": recipe,
    }
    if args.tr:
        runs["CoMiGS-1G1S-tr"] = variant_recipe(base_1g1s, "tr")
    if args.variants:
        wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in wanted if v not in runs]
        if unknown:
            raise SystemExit(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(runs)})")
        runs = {name: runs[name] for name in wanted}
    t_start, c_start = time.perf_counter(), time.process_time()
    fed0 = prepare(base_1g1s, args.recipe.parent)
    data = [c.data for c in fed0.clients]  # tokenized once, shared by every method
    users = [u.name for u in recipe.users]
    # per method, per user: test/train perplexity and (CoMiGS) the generalist's weight per layer
    results: dict[str, dict[str, dict[str, Any]]] = {
        "Pretrained": {
            u: {"test": c.perplexity("test", args.eval_tokens)} for u, c in zip(users, fed0.clients, strict=True)
        }
    }
    seconds: dict[str, float] = {}
    cpu_seconds: dict[str, float] = {}
    for name, r in runs.items():
        t0, c0 = time.perf_counter(), time.process_time()
        fed = run_inprocess(prepare(r, args.recipe.parent, data=data))
        seconds[name] = time.perf_counter() - t0
        cpu_seconds[name] = time.process_time() - c0  # one thread: CPU time is what an idle core would take
        results[name] = {
            u: {
                "test": c.perplexity("test", args.eval_tokens),
                "train": c.perplexity("train", min(4096, args.eval_tokens)),
            }
            | generalist_share(c)
            for u, c in zip(users, fed.clients, strict=True)
        }
        row = "  ".join(f"{u} {v['test']:.2f}" for u, v in results[name].items())
        print(f"{name:22s} {row}   ({cpu_seconds[name]:.0f} s CPU, {seconds[name]:.0f} s wall)", flush=True)
    total = time.perf_counter() - t_start
    total_cpu = time.process_time() - c_start

    lines = ["| Method | " + " | ".join(users) + " | mean |", "|---" * (len(users) + 2) + "|"]
    for name, res in results.items():
        vals = [res[u]["test"] for u in users]
        lines.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {sum(vals) / len(vals):.2f} |")
    gap = ["| Method | " + " | ".join(f"{u} train/test" for u in users) + " |", "|---" * (len(users) + 1) + "|"]
    for name, res in results.items():
        if name == "Pretrained":
            continue
        gap.append(f"| {name} | " + " | ".join(f"{res[u]['train']:.1f} / {res[u]['test']:.1f}" for u in users) + " |")
    share = [
        f"{name}: "
        + ", ".join(
            f"{u} " + "/".join(f"{x:.2f}" for x in res[u]["generalist_weight_per_layer"])
            for u in users
            if "generalist_weight_per_layer" in res[u]
        )
        for name, res in results.items()
        if any("generalist_weight_per_layer" in v for v in res.values())
    ]
    claims = []
    have_table2 = all(k in results for k in ("CoMiGS-2S", "CoMiGS-2G", "CoMiGS-1G1S"))
    for u in users if have_table2 else []:
        s2, g2, one = (results[k][u]["test"] for k in ("CoMiGS-2S", "CoMiGS-2G", "CoMiGS-1G1S"))
        best, worst = min(s2, g2), max(s2, g2)
        claims.append(
            f"{u}: 1G1S {one:.2f} vs 2S {s2:.2f} / 2G {g2:.2f} -> "
            f"{'at or below the better' if one <= best else 'between' if one <= worst else 'above both'}"
        )
    t = recipe.training
    report = {
        "recipe": str(args.recipe.relative_to(ROOT)) if args.recipe.is_relative_to(ROOT) else str(args.recipe),
        "schedule": {
            "rounds": t.rounds,
            "local_iterations": t.local_iterations,
            "router_every": t.router_every,
            "router_steps": t.router_steps,
            "batch": [t.batch_size, t.seq_len],
        },
        "train_tokens": {u: len(d.train) for u, d in zip(users, data, strict=True)},
        "eval_tokens": args.eval_tokens,
        "seed": {"lora": recipe.lora.seed, "training": recipe.training.seed},
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "total_seconds": total,
        "total_cpu_seconds": total_cpu,
        "results": results,
        "claims_1g1s": claims,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comigs_experiment.json").write_text(json.dumps(report, indent=2) + "\n")
    md = "\n".join(
        [
            "## test perplexity",
            *lines,
            "",
            "## train / test perplexity",
            *gap,
            "",
            *claims,
            "",
            "## mean generalist routing weight per layer (test tokens)",
            *share,
            f"\ntotal {total_cpu:.0f} s CPU on {args.threads} thread(s) ({total:.0f} s wall)",
        ]
    )
    (args.out / "comigs_experiment.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
