"""SCAR's measured cost against full causal attention, one CPU thread, at several sequence lengths.

The paper counts k·n + n "operations" for SCAR against n² for attention (86.7 % fewer at n = 128, k = 16). That is
the cost of the centroid distances, not of attention. Here, per (T, k), median wall time of one attention call
([1, H, T, hd]) for: full causal attention (matmul + additive mask + softmax), SCAR as a masked dense call (what the
exported graph runs: same cost plus the mask), SCAR gathered per cluster (the sparse form: Σ|C|² score entries),
and the cluster assignment itself; plus score entries computed (causal) and the paper's count.

    .venv/bin/python bench/gem_scar.py [--json out/gem-scar.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moetool.methods.gem.scar import (
    assign_clusters,
    clustered_attention,
    kmeans_cosine,
    masked_attention,
    scar_mask,
    scar_score_entries,
)


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--lengths", default="128,256,512,1024,2048")
    ap.add_argument("--clusters", default="8,16")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    d_model = args.heads * args.head_dim
    rows = []
    print(
        f"{'T':>5} {'k':>3} {'full ms':>8} {'masked ms':>9} {'gathered ms':>11} {'assign ms':>9} "
        f"{'entries full':>12} {'entries scar':>12} {'paper k·n+n':>11}"
    )
    for t in map(int, args.lengths.split(",")):
        q, k, v = (torch.randn(1, args.heads, t, args.head_dim, generator=g) for _ in range(3))
        h = torch.randn(1, t, d_model, generator=g)
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        full = timed(lambda: masked_attention(q, k, v, causal), args.repeats)  # noqa: B023
        for n_clusters in map(int, args.clusters.split(",")):
            mu = kmeans_cosine(h[0], n_clusters, iterations=5)
            labels = assign_clusters(h, mu)
            mask = scar_mask(labels)
            masked = timed(lambda: masked_attention(q, k, v, scar_mask(assign_clusters(h, mu))), args.repeats)  # noqa: B023
            gathered = timed(lambda: clustered_attention(q, k, v, labels), args.repeats)  # noqa: B023
            assign = timed(lambda: assign_clusters(h, mu), args.repeats)  # noqa: B023
            err = float((masked_attention(q, k, v, mask) - clustered_attention(q, k, v, labels)).abs().max())
            row = {
                "T": t,
                "k": n_clusters,
                "full_ms": round(full, 3),
                "scar_masked_ms": round(masked, 3),
                "scar_gathered_ms": round(gathered, 3),
                "assign_ms": round(assign, 3),
                "entries_full": t * (t + 1) // 2,
                "entries_scar": scar_score_entries(labels),
                "paper_count": n_clusters * t + t,
                "masked_vs_gathered_max_diff": err,
            }
            rows.append(row)
            print(
                f"{t:>5} {n_clusters:>3} {full:>8.3f} {masked:>9.3f} {gathered:>11.3f} {assign:>9.3f} "
                f"{row['entries_full']:>12} {row['entries_scar']:>12} {row['paper_count']:>11}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"heads": args.heads, "head_dim": args.head_dim, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
