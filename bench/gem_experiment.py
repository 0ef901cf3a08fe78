"""GEM on the zoo: router quality per encoder setting, and the fallback experiment (one CPU thread, a few minutes).

For each router variant (per-token features as in the paper, or the causal prefix mean; one or two encoder layers)
it assembles the token-level GEM model from recipes/demo-gem.yaml, then reports the held-out router table (accuracy
and fallback share as tau varies) and the GEM evaluation: perplexity, GG/DSI for GEM at tau 0.7 / 0 / 1, the
general model and each expert, and per domain whether the fallback reduces the generalization gap against the
plain expert and at what in-domain cost.

    .venv/bin/python bench/gem_experiment.py --json out/gem-experiment.json [--seed 1]

--seed N sets router.seed (the router's initialisation and batches) and qat.seed (QAT batches) to N; the experts and
the held-out text do not depend on it. Seed 0 is the recipe's default.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "token-1": {"context": "token", "encoder_layers": 1},  # the paper's per-token router, 1 encoder layer
    "token-2": {"context": "token", "encoder_layers": 2},
    "prefix-1": {"context": "prefix", "encoder_layers": 1},  # causal running mean of the features
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=ROOT / "out" / "gem-experiment.json")
    ap.add_argument("--max-tokens", type=int, default=8192, help="held-out tokens per domain")
    ap.add_argument("--qat-steps", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=None, help="Set router.seed and qat.seed (default: the recipe's).")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from moetool.api import assemble
    from moetool.methods.gem.evaluate import gem_report
    from moetool.zoo import resolve_zoo_model, zoo_domain_text

    base = yaml.safe_load((ROOT / "recipes" / "demo-gem.yaml").read_text())
    domains = [d["name"] for d in base["domains"]]
    texts = {d: zoo_domain_text(d, "valid") for d in domains}
    experts = {d: resolve_zoo_model(d) for d in domains}
    variants: dict[str, object] = {}
    results = {"max_tokens": args.max_tokens, "seed": args.seed or 0, "variants": variants}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants.split(","):
            t0 = time.perf_counter()
            r = json.loads(json.dumps(base))
            r["router"] |= VARIANTS[name]
            r["qat"]["steps"] = args.qat_steps
            if args.seed is not None:
                r["router"]["seed"] = r["qat"]["seed"] = args.seed
            path = Path(tmp) / "gem.yaml"
            path.write_text(yaml.safe_dump(r))
            out = assemble(path, Path(tmp) / "model", force=True)
            rep = json.loads((out / "gem-report.json").read_text())
            ev = gem_report(out, resolve_zoo_model("base"), experts, texts, max_tokens=args.max_tokens)
            variants[name] = {
                "router": rep["router"],
                "router_seconds": rep["router_training"]["seconds"],
                "qat": rep.get("qat"),
                "eval": ev,
                "seconds": round(time.perf_counter() - t0, 1),
            }
            row = {t["tau"]: t for t in rep["router"]["by_tau"]}[0.7]
            print(
                f"{name}: argmax acc {rep['router']['argmax_accuracy']:.3f}, at tau 0.7 fallback {row['fallback']:.3f}"
                f" routed acc {row['routed_accuracy']}"
            )
            for d, e in ev["experiment"].items():
                print(
                    f"  {d}: GG expert {e['gg_expert']:.3f} gem {e['gg_gem']:.3f} (tau 0: {e['gg_gem_no_fallback']:.3f})"
                    f"; in-domain ppl expert {e['ppl_in_domain_expert']:.2f} gem {e['ppl_in_domain_gem']:.2f} "
                    f"(tau 0: {e['ppl_in_domain_no_fallback']:.2f}); out-of-domain ppl expert "
                    f"{e['ppl_out_of_domain_expert']:.2f} gem {e['ppl_out_of_domain_gem']:.2f}"
                )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
