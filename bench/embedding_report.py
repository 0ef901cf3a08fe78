"""Routed input embeddings on the zoo base: parameters saved against held-out perplexity, against fair baselines.

    .venv/bin/python bench/embedding_report.py [--steps 120] [--lrs 1e-3,3e-3,1e-2] [--out out/embedding-report]

One CPU thread. Every arm (generative, remix, dense of the same parameter count, dense of the same depth, dense of
the same width, full-width dense) replaces the input embedding of the frozen zoo base, starts from the SVD retrofit
and trains with the same budget and LR sweep (see moetool.methods.embedding.report). Then batch-1 decode latency
with the caches: the original model against the routed one (the router's overhead per token).
Writes report.json and report.md into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from moetool.io.atomic import atomic_dir
from moetool.methods.embedding.report import default_arms, render_markdown, run_report


@torch.no_grad()
def decode_ms(step, prompt: torch.Tensor, n: int = 32) -> float:  # type: ignore[no-untyped-def]
    """Median ms per generated token with the cache (greedy), after a prefill of ``prompt``."""
    logits, state = step(prompt, None)
    times = []
    for _ in range(n):
        nxt = logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        logits, state = step(nxt, state)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def latency(model_ref: str) -> dict[str, float]:
    from transformers import DynamicCache

    from moetool.methods.embedding.assemble import load_source_model
    from moetool.methods.embedding.report import default_arms
    from moetool.methods.embedding.retrofit import retrofit

    _, source, _ = load_source_model(model_ref, None)
    prompt = torch.randint(0, source.config.vocab_size, (1, 64))

    def orig_step(ids, state):  # type: ignore[no-untyped-def]
        cache = state or DynamicCache(config=source.config)
        out = source(ids, past_key_values=cache, use_cache=True)
        return out.logits, out.past_key_values

    arms = default_arms(source.config.vocab_size, source.config.hidden_size)
    out = {"original": decode_ms(orig_step, prompt)}
    for name in ("generative", "remix"):
        m = retrofit(source, arms[name]).eval()
        out[name] = decode_ms(m.step, prompt)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="zoo:base")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path("out/embedding-report"))
    ap.add_argument("--seed", type=int, default=0, help="Router init and batch sampling.")
    ap.add_argument("--arms", default="", help="Comma-separated subset of the default arms (default: all).")
    ap.add_argument(
        "--seed-dim", type=int, default=32, help="Seed-table width of the generative arm (recipes/real-embedding: 128)."
    )
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    arms = None
    if args.arms or args.seed_dim != 32:
        from moetool.methods.embedding.assemble import load_source_model

        cfg = load_source_model(args.model, None)[1].config
        # the model's own position count, as run_report uses: the router's position table is part of the generative
        # budget, so the params-matched dense width depends on it
        every = default_arms(
            cfg.vocab_size,
            cfg.hidden_size,
            seed_dim=args.seed_dim,
            max_positions=int(getattr(cfg, "max_position_embeddings", 512)),
        )
        arms = {a: every[a] for a in args.arms.split(",")} if args.arms else every
    rep = run_report(
        args.model,
        arms=arms,
        steps=args.steps,
        seed=args.seed,
        learning_rates=tuple(float(x) for x in args.lrs.split(",")),
        eval_tokens=args.eval_tokens,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    md = render_markdown(rep)
    if not args.no_latency:
        rep["decode_ms_per_token_batch1"] = latency(args.model)
        md += "\n\nBatch-1 decode, ms/token (median of 32, cached, 1 thread): " + ", ".join(
            f"{k} {v:.2f}" for k, v in rep["decode_ms_per_token_batch1"].items()
        )
    with atomic_dir(args.out, force=args.force) as tmp:
        (tmp / "report.json").write_text(json.dumps(rep, indent=2))
        (tmp / "report.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
