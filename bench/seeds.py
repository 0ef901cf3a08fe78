"""Run one recipe under several seeds and print chosen figures as mean ± spread (half the range), so a claim in
docs/ says whether it holds across seeds.

Each seed gets a copy of the recipe with ``train.seed`` (or ``--seed-key``) set, plus any ``--set key=value``
overrides (dotted keys, YAML values), merged with ``moetool merge`` into ``OUT/seed-N``. Figures are read from a JSON
file the merge writes, as ``FILE:dotted.path`` (list indices as numbers).

``--then`` runs a command on each output (an evaluation that writes the JSON the figures come from); given several
times, the commands run in order. ``{out}`` is the seed's merge output and ``{recipe}`` its recipe copy, so a
method whose training is a separate command (mofe: ``moetool train {recipe} --model {out} -o {out}-tuned``) can be
seeded too.

Run:  .venv/bin/python bench/seeds.py recipes/real-hybrid.yaml -o out/seeds-hybrid --seeds 0,1,2 \
        --set loss.lambda_penalty=0 \
        --metric hybrid.json:held_out.rows.router.perplexity \
        --metric "hybrid.json:held_out.rows.transformer alone.perplexity"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

BIN = Path(sys.executable).parent


def set_path(doc: dict[str, Any], key: str, value: Any) -> None:
    node = doc
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def get_path(doc: Any, path: str) -> float:
    """``a.b.0.c``, or ``a/b c (x=0.7)/d`` when a key holds dots."""
    for part in path.split("/" if "/" in path else "."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return float(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--seed-key", default="train.seed", help="dotted key(s) set to the seed, comma-separated")
    ap.add_argument(
        "--then",
        action="append",
        default=[],
        help="a command run after each merge ({out}: the merge's output, {recipe}: the seed's recipe); repeatable",
    )
    ap.add_argument("--set", action="append", default=[], help="dotted.key=yaml-value, applied to every seed")
    ap.add_argument("--metric", action="append", required=True, help="FILE:dotted.path in the merge's output")
    ap.add_argument("--reuse", action="store_true", help="read outputs already there instead of merging again")
    args = ap.parse_args()
    base = yaml.safe_load(args.recipe.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[float]] = {m: [] for m in args.metric}
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        doc = json.loads(json.dumps(base))
        for item in args.set:
            key, _, value = item.partition("=")
            set_path(doc, key, yaml.safe_load(value))
        for key in args.seed_key.split(","):
            set_path(doc, key, seed)
        doc["name"] = f"{base['name']}-seed{seed}"
        recipe = args.out / f"{doc['name']}.yaml"
        recipe.write_text(yaml.safe_dump(doc, sort_keys=False))
        out = args.out / f"seed-{seed}"
        if not (args.reuse and out.is_dir()):
            cmd = [str(BIN / "moetool"), "merge", str(recipe), "-o", str(out), "--force"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            for command in args.then:
                then = [w.replace("{out}", str(out)).replace("{recipe}", str(recipe)) for w in shlex.split(command)]
                then[0] = str(BIN / then[0]) if (BIN / then[0]).exists() else then[0]
                subprocess.run(then, check=True, stdout=subprocess.DEVNULL)
        for m in args.metric:
            file, _, path = m.partition(":")
            rows[m].append(get_path(json.loads((out / file).read_text()), path))
        print(f"seed {seed}: " + "; ".join(f"{m.split(':', 1)[1]} {v[-1]:.4g}" for m, v in rows.items()), flush=True)
    print(f"{len(seeds)} seeds ({args.seeds}), mean ± half-range:")
    for m, v in rows.items():
        print(
            f"  {m.split(':', 1)[1]}: {statistics.mean(v):.4g} ± {(max(v) - min(v)) / 2:.2g}  ({', '.join(f'{x:.4g}' for x in v)})"
        )


if __name__ == "__main__":
    main()
