"""MLX beside GGUF on the real SmolLM2 MoE: size, perplexity change per domain and top-1 agreement, plan by plan.

    .venv/bin/python bench/mlx_vs_gguf.py [--model DIR] [--windows 6] [--out out/mlx-bench] [--plans f32,q8_0,moe-q4]
                                          [--targets mlx,gguf] [--table]

Each plan is exported twice by ``moetool export`` (``--target mlx`` and ``--target gguf``, each verified in its own
runtime as the command does), then scored on each zoo domain's held-out split (``--windows`` × 256 tokens): the
artifact's own logits in its runtime (mlx-lm, llama.cpp) against transformers float32 on the same windows —
perplexity per domain, top-1 agreement over every window. Export seconds are wall time of the whole command on this
machine (same process, same machine state for both targets). ``--table`` prints the saved results.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from moetool.api import export
from moetool.export.gguf.verify import llama_logits, load_llama
from moetool.export.heldout import nll
from moetool.zoo import DOMAINS, zoo_domain_text

PLANS = ("f32", "q8_0", "moe-q4")


def windows_of(tok: Any, n: int) -> dict[str, list[list[int]]]:
    out = {}
    for d in DOMAINS:
        ids = tok(zoo_domain_text(d, "valid"), add_special_tokens=False).input_ids
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        out[d] = [[*bos, *ids[i : i + 256 - len(bos)]] for i in range(0, 255 * n, 255)]
    return out


def _score(logits_of: Any, wins: dict[str, list[list[int]]], ref: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    ppl, agree, seen = {}, 0, 0
    for d, ws in wins.items():
        total = n = 0.0
        for w, r in zip(ws, ref[d], strict=True):
            logits = logits_of(w)
            a, k = nll(logits, w)
            total, n = total + a, n + k
            agree += int((logits.argmax(-1) == r).sum())
            seen += len(w)
        ppl[d] = math.exp(total / n)
    return {"ppl": ppl, "top1": agree / seen}


def reference(model: Path, wins: dict[str, list[list[int]]]) -> tuple[dict[str, Any], dict[str, list[np.ndarray]]]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    argmax: dict[str, list[np.ndarray]] = {}

    def logits_of(w: list[int]) -> np.ndarray:
        with torch.inference_mode():
            out: np.ndarray = m(input_ids=torch.tensor([w])).logits[0].numpy()
        return out

    full = {d: [logits_of(w) for w in ws] for d, ws in wins.items()}
    argmax = {d: [x.argmax(-1) for x in xs] for d, xs in full.items()}
    lookup = {tuple(w): x for d, ws in wins.items() for w, x in zip(ws, full[d], strict=True)}
    return _score(lambda w: lookup[tuple(w)], wins, argmax), argmax


def score_mlx(folder: Path, wins: dict[str, list[list[int]]], ref: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    from mlx_lm.utils import load_model

    from moetool.export.mlx.runtime import mlx_logits

    model, _ = load_model(folder)
    return _score(lambda w: mlx_logits(model, w), wins, ref)


def score_gguf(path: Path, wins: dict[str, list[list[int]]], ref: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    llm = load_llama(path, n_ctx=256)
    try:
        return _score(lambda w: llama_logits(llm, w), wins, ref)
    finally:
        llm.close()


def run(model: Path, out: Path, plan: str, target: str, wins: Any, ref: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    man = export(model, out / f"{target}-{plan}", target=target, quant=plan, force=True)
    seconds = time.perf_counter() - t0
    folder = out / f"{target}-{plan}"
    row = {"bytes": man["artifact"]["bytes"], "export_s": round(seconds, 1)}
    scored = score_mlx(folder, wins, ref) if target == "mlx" else score_gguf(folder / man["file"], wins, ref)
    return row | scored


def print_table(res: dict[str, Any]) -> None:
    ref = res["reference"]["ppl"]
    print("| plan | target | size | " + " | ".join(DOMAINS) + " | top-1 vs f32 | export (s) |")
    print("|---|---|---:|" + "---:|" * len(DOMAINS) + "---:|---:|")
    print("| transformers float32 | | | " + " | ".join(f"{ref[d]:.2f}" for d in DOMAINS) + " | | |")
    for key, row in res["rows"].items():
        plan, target = key.split("|")
        change = " | ".join(f"{100 * (row['ppl'][d] / ref[d] - 1):+.1f} %" for d in DOMAINS)
        print(f"| {plan} | {target} | {row['bytes'] / 1e6:.1f} MB | {change} | {row['top1']:.3f} | {row['export_s']} |")
    pairs = [(p, res["rows"].get(f"{p}|mlx"), res["rows"].get(f"{p}|gguf")) for p in PLANS]
    for plan, m, g in pairs:
        if m and g:
            print(
                f"{plan}: mlx/gguf size {m['bytes'] / g['bytes']:.3f}x, export time {m['export_s'] / g['export_s']:.2f}x"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="out/demo/merged")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("out/mlx-bench"))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--targets", default="mlx,gguf")
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out's results; run nothing")
    args = ap.parse_args()
    done = args.out / "results.json"
    if args.table:
        print_table(json.loads(done.read_text()))
        return
    from transformers import AutoTokenizer

    model = Path(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    wins = windows_of(AutoTokenizer.from_pretrained(str(model)), args.windows)
    cached = args.out / "reference.npz"
    if done.is_file() and cached.is_file() and json.loads(done.read_text())["model"] == str(model):
        ref_scores = json.loads(done.read_text())["reference"]
        with np.load(cached) as z:
            ref = {d: [z[f"{d}.{i}"] for i in range(len(wins[d]))] for d in wins}
    else:
        ref_scores, ref = reference(model, wins)
        np.savez(cached, **{f"{d}.{i}": a for d, xs in ref.items() for i, a in enumerate(xs)})
    res: dict[str, Any] = {"model": str(model), "windows": args.windows, "reference": ref_scores, "rows": {}}
    if done.is_file():  # a rerun with other --plans or --targets adds to the table (same model and windows)
        old = json.loads(done.read_text())
        if (old["model"], old["windows"]) == (res["model"], res["windows"]):
            res["rows"] = old["rows"]
    for plan in args.plans.split(","):
        for target in args.targets.split(","):
            res["rows"][f"{plan}|{target}"] = run(model, args.out, plan, target, wins, ref)
            print(plan, target, res["rows"][f"{plan}|{target}"], flush=True)
            done.write_text(json.dumps(res, indent=2))
    print_table(res)


if __name__ == "__main__":
    main()
