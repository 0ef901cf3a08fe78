"""GGUF in llama.cpp: speed of the merged MoE against one dense expert, and size/perplexity of hybrid vs uniform plans.

    .venv/bin/python bench/gguf_quality_speed.py [--model out/demo/tuned-mofe] [--windows 8]

Prints two tables. Speed: prompt (prefill) and generation tokens/s in llama-cpp-python for the MoE and the zoo's
code expert at the same precision, and their ratio. Quality: for each plan, file size, bits/weight and held-out
perplexity (zoo validation text, every domain) computed from llama.cpp's own logits; then every (hybrid, uniform)
pair where the hybrid is no larger and has lower perplexity.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moetool.api import export
from moetool.export.gguf.verify import llama_logits, load_llama
from moetool.export.heldout import nll
from moetool.zoo import DOMAINS, resolve_zoo_model, zoo_domain_text

UNIFORM = ("f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
HYBRID = (
    "moe-q5",
    "moe-q4",
    "gem",
    "experts=q4_0,embeddings=q8_0,output=q8_0,router=f32,*=q5_0",
    "experts=q4_0,embeddings=q5_0,router=f32,*=q8_0",
    "experts=q4_1,router=f32,*=q8_0",
    "experts=q5_0,embeddings=q4_0,router=f32,*=q8_0",
)


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    for cand in (Path("out/demo/tuned-mofe"), Path("out/demo/merged")):
        if (cand / "config.json").is_file():
            return cand
    sys.exit("no model: run `moetool demo` first or pass --model")


def speed(gguf: Path, prompt: list[int], gen: int, reps: int = 3) -> tuple[float, float]:
    llm = load_llama(gguf, n_ctx=len(prompt) + gen + 8)
    pre, dec = [], []
    try:
        for _ in range(reps):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            pre.append(len(prompt) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for _ in range(gen):
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                llm.eval([tok])
            dec.append(gen / (time.perf_counter() - t0))
    finally:
        llm.close()
    return statistics.median(pre), statistics.median(dec)


def active_bytes(gguf: Path, top_k: int) -> tuple[int, int]:
    """(bytes a token reads, bytes in the file's tensors): every tensor once, an expert bank (``*_exps``) k/E of it.
    The token embedding is a row lookup, not a full read, unless it is also the output head (tied: no
    ``output.weight``)."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(gguf)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    read = total = 0
    for t in tensors:
        n = int(t.n_bytes)
        total += n
        if t.name == "token_embd.weight" and not tied:
            continue
        if "_exps" in t.name:
            experts = int(t.shape[-1]) if len(t.shape) == 3 else 1
            read += n * top_k // experts
        else:
            read += n
    return read, total


def perplexity(gguf: Path, windows: list[list[int]]) -> float:
    llm = load_llama(gguf, n_ctx=max(len(w) for w in windows))
    try:
        total = n = 0.0
        for w in windows:
            a, k = nll(llama_logits(llm, w), w)
            total += a
            n += k
    finally:
        llm.close()
    return math.exp(total / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--windows", type=int, default=8, help="256-token windows per domain for perplexity")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--dense", default="code", help="the dense peer: a zoo name (code, smollm2-code) or a folder")
    ap.add_argument("--quants", default="f16,q8_0,q4_0", help="plans for the speed table")
    ap.add_argument("--speed-only", action="store_true", help="skip the quality-vs-size table")
    args = ap.parse_args()
    moe = model_dir(args.model)
    dense = Path(args.dense) if Path(args.dense).is_dir() else resolve_zoo_model(args.dense)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(moe))
    windows = []
    for d in DOMAINS:
        ids = tok(zoo_domain_text(d, "valid"), add_special_tokens=False).input_ids
        windows += [[tok.bos_token_id, *ids[i : i + 255]] for i in range(0, 255 * args.windows, 255)]
    prompt = windows[0][:256]

    with tempfile.TemporaryDirectory(prefix="moetool-bench-") as tmp:

        def art(model: Path, quant: str, tag: str) -> tuple[Path, dict]:
            out = Path(tmp) / tag
            m = export(model, out, quant=quant, verify=False)
            return out / m["file"], m

        print(f"MoE: {moe} | dense: {args.dense} ({dense}) | llama.cpp via llama-cpp-python, 2 threads max\n")
        print("speed (tokens/s, median of 3); ceiling = dense bytes read per token ÷ the MoE's (top-k of each bank)")
        print(
            f"{'plan':8} {'MoE prefill':>12} {'dense prefill':>14} {'ratio':>6} {'MoE gen':>9} {'dense gen':>10} "
            f"{'ratio':>6} {'ceiling':>8} {'prefill/ceil':>12} {'gen/ceil':>9}"
        )
        import json

        top_k = int(json.loads((moe / "config.json").read_text())["num_experts_per_tok"])
        for q in args.quants.split(","):
            moe_gguf, dense_gguf = art(moe, q, f"moe-{q}")[0], art(dense, q, f"dense-{q}")[0]
            mp, md = speed(moe_gguf, prompt, args.gen)
            dp, dd = speed(dense_gguf, prompt, args.gen)
            ceiling = active_bytes(dense_gguf, 1)[0] / active_bytes(moe_gguf, top_k)[0]
            print(
                f"{q:8} {mp:12.0f} {dp:14.0f} {mp / dp:6.2f} {md:9.0f} {dd:10.0f} {md / dd:6.2f} {ceiling:8.2f} "
                f"{mp / dp / ceiling:12.2f} {md / dd / ceiling:9.2f}"
            )
        if args.speed_only:
            return

        print(f"\nquality vs size ({len(windows)} windows × 256 tokens of held-out text, {len(DOMAINS)} domains)")
        print(f"{'plan':58} {'kind':8} {'bytes':>10} {'bpw':>6} {'ppl':>8}")
        rows = []
        for q in UNIFORM + HYBRID:
            path, m = art(moe, q, f"q-{len(rows)}")
            ppl = perplexity(path, windows)
            kind = "uniform" if q in UNIFORM else "hybrid"
            rows.append((q, kind, path.stat().st_size, m["plan"]["bits_per_weight"], ppl))
            print(f"{q:58} {kind:8} {rows[-1][2]:10,} {rows[-1][3]:6.2f} {ppl:8.3f}")
        wins = [
            (h, u) for h in rows if h[1] == "hybrid" for u in rows if u[1] == "uniform" and h[2] <= u[2] and h[4] < u[4]
        ]
        print("\nhybrid plans no larger than a uniform plan and with lower perplexity:")
        for h, u in wins:
            print(f"  {h[0]} ({h[2]:,} B, ppl {h[4]:.3f})  beats  {u[0]} ({u[2]:,} B, ppl {u[4]:.3f})")
        if not wins:
            print("  none")


if __name__ == "__main__":
    main()
