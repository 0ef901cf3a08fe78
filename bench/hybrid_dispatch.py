"""Does a hybrid export's shipped dispatch.py route held-out requests as training built them?

Training starts every request with the tokenizer's BOS and then the text's ids without special tokens. This script
cuts held-out requests (text) from the recipe's domains, builds the ids three ways, runs the exported router.onnx on
each and counts how often the routes differ from training's:

- training: ``[tok.bos_token_id, *tok(text, add_special_tokens=False)]`` (moetool.methods.hybrid.data);
- the shipped ``dispatch.py`` of the export (what a user runs);
- the dispatcher before it read the BOS from the export (``<s>`` looked up by name, the tokenizer's post-processor
  otherwise), for comparison.

    .venv/bin/python bench/hybrid_dispatch.py recipes/real-hybrid.yaml out/real-hybrid-export --per-domain 30
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from moetool.recipe import load_recipe
from moetool.train.data import load_source


def _old_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text).ids
    bos = tokenizer.token_to_id("<s>")
    return list(ids) if not ids or bos is None or ids[0] == bos else [bos, *ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe", type=Path)
    ap.add_argument("export", type=Path)
    ap.add_argument("--per-domain", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    recipe: Any = load_recipe(args.recipe)
    spec = importlib.util.spec_from_file_location("shipped_dispatch", args.export / "dispatch.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["shipped_dispatch"] = mod
    spec.loader.exec_module(mod)
    d = mod.Dispatcher(args.export)
    tok = AutoTokenizer.from_pretrained(str(args.export / "tokenizer"))
    rng = random.Random(args.seed)
    counts = {
        "requests": 0,
        "shipped ids differ": 0,
        "shipped route differs": 0,
        "old ids differ": 0,
        "old route differs": 0,
    }
    for domain, src in recipe.train.data.items():
        _, held = load_source(
            domain, src, base_dir=recipe.recipe_dir, fraction=recipe.train.validation_fraction, seed=recipe.train.seed
        )
        words = held.split()
        for _ in range(args.per_domain):
            n = rng.randint(8, 150)
            start = rng.randrange(0, max(1, len(words) - n))
            text = " ".join(words[start : start + n])
            trained = [tok.bos_token_id, *tok(text, add_special_tokens=False).input_ids]
            route = d.route(trained, domain)[0]
            shipped = d.ids(text)
            counts["requests"] += 1
            counts["shipped ids differ"] += shipped != trained
            counts["shipped route differs"] += d.route(shipped, domain)[0] != route
            old = _old_ids(d.tokenizer, text)
            counts["old ids differ"] += old != trained
            counts["old route differs"] += d.route(old, domain)[0] != route
    print(f"BOS {tok.bos_token!r} = {tok.bos_token_id}; '<s>' = {d.tokenizer.token_to_id('<s>')}")
    for k, v in counts.items():
        print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
