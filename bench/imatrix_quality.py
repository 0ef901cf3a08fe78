"""Low-bit experts with importance matrices on the real SmolLM2 MoE: quality per domain at equal GGUF size.

    .venv/bin/python bench/imatrix_quality.py [--model DIR] [--windows 8] [--out out/imatrix-bench]
                                               [--llama-tools out/llama-tools/bin] [--plans NAME,NAME]

Every plan is a GGUF written by ``moetool export``; the calibration text is the training split of the model
recipe's domains (the zoo's), the scoring text each domain's held-out split (``--windows`` × 256 tokens each).
Figures per plan: file size, perplexity per domain from llama.cpp's own logits against transformers float32 on the
same windows, top-1 agreement with transformers float32, and whether ``moetool export``'s conversion check (llama.cpp
against transformers on the artifact's own weights, top-1 ≥ 0.95) passes. Imatrix variants:

- none: llama.cpp's rounding without importance weights;
- llama.cpp-style: moetool's collector with no floor (llama.cpp's statistics: each expert over its routed tokens);
- ``llama-imatrix``: llama.cpp's own tool on the f16 GGUF over the same calibration text (when ``--llama-tools`` holds
  a build of it), read back by ``moetool export --imatrix FILE``;
- moetool routed: every expert with at least 128 tokens (those below computed on every token);
- moetool all: every expert over every token.

It ends with the tokens each expert of a few layers saw in each imatrix.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from moetool.api import export
from moetool.export.base import ExportError
from moetool.export.gguf.verify import llama_logits, load_llama
from moetool.export.heldout import nll
from moetool.export.resolve import recipe_domain_text
from moetool.quant.imatrix import Calibration
from moetool.quant.imatrix import load as load_imatrix
from moetool.zoo import DOMAINS, zoo_domain_text

# name → (--quant, imatrix kind)
PLANS: dict[str, tuple[str, str]] = {
    "q8_0": ("q8_0", "none"),
    "moe-q5": ("moe-q5", "none"),
    "moe-q4": ("moe-q4", "none"),
    "moe-q4 llama.cpp-style": ("moe-q4", "llama-style"),
    "moe-q4 llama-imatrix": ("moe-q4", "llama-tool"),
    "moe-q4 moetool routed": ("moe-q4", "routed"),
    "moe-q4 moetool all": ("moe-q4", "all"),
    "iq4_nl experts moetool": ("experts=iq4_nl,router=f32,*=q8_0", "routed"),
    "q4_1 experts": ("experts=q4_1,router=f32,*=q8_0", "none"),
    "q4_1 experts moetool": ("experts=q4_1,router=f32,*=q8_0", "routed"),
    "q4_k experts": ("experts=q4_k,router=f32,*=q8_0", "none"),
    "q4_k experts moetool": ("experts=q4_k,router=f32,*=q8_0", "routed"),
    "q3_k experts moetool": ("experts=q3_k,router=f32,*=q8_0", "routed"),
    "q2_k experts llama.cpp-style": ("experts=q2_k,router=f32,*=q8_0", "llama-style"),
    "q2_k experts moetool": ("experts=q2_k,router=f32,*=q8_0", "routed"),
    "q2_k experts moetool all": ("experts=q2_k,router=f32,*=q8_0", "all"),
    "allocated at moe-q4 size": ("budget=MOEQ4,router=f32", "routed"),
    "allocated under 190 MB": ("budget=181M,router=f32", "routed"),
    # the second family's small sizes (its embeddings are half its bytes)
    "q4_k everywhere": ("q4_k", "none"),
    "q4_k everywhere moetool": ("q4_k", "routed"),
    "allocated at 12 MiB": ("budget=12M,router=f32", "routed"),
}


def windows_of(tok: Any, n: int) -> dict[str, list[list[int]]]:
    out = {}
    for d in DOMAINS:
        ids = tok(zoo_domain_text(d, "valid"), add_special_tokens=False).input_ids
        out[d] = [[tok.bos_token_id, *ids[i : i + 255]] for i in range(0, 255 * n, 255)]
    return out


def hf_reference(model: Path, wins: dict[str, list[list[int]]]) -> tuple[dict[str, float], dict[str, list[np.ndarray]]]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    ppl, argmax = {}, {}
    with torch.inference_mode():
        for d, ws in wins.items():
            total = n = 0.0
            argmax[d] = []
            for w in ws:
                logits = m(input_ids=torch.tensor([w])).logits[0].numpy()
                a, k = nll(logits, w)
                total, n = total + a, n + k
                argmax[d].append(logits.argmax(-1))
            ppl[d] = math.exp(total / n)
    return ppl, argmax


def score(gguf: Path, wins: dict[str, list[list[int]]], ref_argmax: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    llm = load_llama(gguf, n_ctx=256)
    ppl, agree, seen = {}, 0, 0
    try:
        for d, ws in wins.items():
            total = n = 0.0
            for w, ref in zip(ws, ref_argmax[d], strict=True):
                logits = llama_logits(llm, w)
                a, k = nll(logits, w)
                total, n = total + a, n + k
                agree += int((logits.argmax(-1) == ref).sum())
                seen += len(w)
            ppl[d] = math.exp(total / n)
    finally:
        llm.close()
    return {"ppl": ppl, "top1": agree / seen}


def llama_tool_imatrix(tools: Path, model: Path, calib: Calibration, work: Path, tok: Any) -> Path | None:
    """llama.cpp's own collection: llama-imatrix on the f16 GGUF over the calibration text, GGUF output."""
    exe = tools / "llama-imatrix"
    if not exe.is_file():
        return None
    f16 = work / "f16"
    if not (f16 / "manifest.json").is_file():
        export(model, f16, quant="f16", verify=False, force=True)
    gguf = f16 / json.loads((f16 / "manifest.json").read_text())["file"]
    text = work / "calibration.txt"
    # the same tokens moetool's collector reads: each domain's first max_tokens / domains tokens
    per = calib.max_tokens // len(calib.texts)
    parts = [tok.decode(tok(t[: per * 32], add_special_tokens=False).input_ids[:per]) for t in calib.texts.values()]
    text.write_text("\n\n".join(parts), encoding="utf-8")
    out = work / "llama-imatrix.imatrix.gguf"
    chunks = calib.max_tokens // 512
    subprocess.run(
        [str(exe), "-m", str(gguf), "-f", str(text), "-o", str(out), "-c", "512", "--chunks", str(chunks), "-t", "2",
         "--no-ppl"],
        check=True, capture_output=True,
    )  # fmt: skip
    return out


def run_plan(
    model: Path, out: Path, quant: str, im: Any, wins: dict[str, list[list[int]]], ref_argmax: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Export one plan (with its conversion check; without it when that fails, to score it anyway) and score it."""
    t1 = time.perf_counter()
    row: dict[str, Any] = {"quant": quant}
    try:
        m = export(model, out, quant=quant, imatrix=im, force=True)
        row["conversion"] = {"passes": True, "top1": m["parity"]["conversion"]["top1_agreement"]}
    except ExportError as exc:
        if "parity failed" not in str(exc):
            raise
        row["conversion"] = {"passes": False, "why": str(exc)[:120]}
        m = export(model, out, quant=quant, imatrix=im, force=True, verify=False)
    gguf = out / m["file"]
    row["bytes"] = gguf.stat().st_size
    row |= score(gguf, wins, ref_argmax)
    if "imatrix" in m:
        row["expert_tokens"] = m["imatrix"]["expert_tokens"]
    if "allocation" in m:
        row["allocation"] = {"budget": m["allocation"]["budget"], "types": _types(m["allocation"]["banks"])}
    row["seconds"] = round(time.perf_counter() - t1, 1)
    return row, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="out/experts-bench/code-legal-medical-tuned-s0")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("out/imatrix-bench"))
    ap.add_argument("--llama-tools", type=Path, default=Path("out/llama-tools/bin"))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out's results; run nothing")
    args = ap.parse_args()
    if args.table:
        print_table(json.loads((args.out / "results.json").read_text()))
        return
    from transformers import AutoTokenizer

    model = Path(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(model))
    wins = windows_of(tok, args.windows)
    t0 = time.perf_counter()
    ref_ppl, ref_argmax = hf_reference(model, wins)
    print(f"transformers float32: {ref_ppl} ({time.perf_counter() - t0:.0f} s)", flush=True)
    texts = recipe_domain_text(model)
    calibs = {
        "llama-style": Calibration(texts, source="recipe", mode="routed", min_tokens=0),
        "routed": Calibration(texts, source="recipe", mode="routed", min_tokens=128),
        "all": Calibration(texts, source="recipe", mode="all"),
    }
    done = args.out / "results.json"
    # a rerun with other --plans adds to the table (same model and windows)
    results: dict[str, Any] = json.loads(done.read_text())["plans"] if done.is_file() else {}
    tool_file = None
    if "llama-tool" in {PLANS[p][1] for p in args.plans.split(",")}:
        tool_file = llama_tool_imatrix(args.llama_tools, model, calibs["routed"], args.out, tok)
    moeq4: int | None = results.get("moe-q4", {}).get("tensor_bytes")
    for name in args.plans.split(","):
        quant, kind = PLANS[name]
        if "MOEQ4" in quant:
            if moeq4 is None:
                continue
            quant = quant.replace("MOEQ4", str(moeq4))
        im: Any = None if kind == "none" else tool_file if kind == "llama-tool" else calibs[kind]
        if kind == "llama-tool" and tool_file is None:
            continue
        row, m = run_plan(model, args.out / name.replace(" ", "_").replace(",", ""), quant, im, wins, ref_argmax)
        row["imatrix"] = kind
        row["ppl_change"] = {d: row["ppl"][d] / ref_ppl[d] - 1 for d in ref_ppl}
        row["tensor_bytes"] = int(m["plan"]["total_bytes"])
        if name == "moe-q4":
            moeq4 = row["tensor_bytes"]
        results[name] = row
        ch = ", ".join(f"{d} {100 * v:+.1f}%" for d, v in row["ppl_change"].items())
        print(
            f"{name:26} {row['bytes'] / 1e6:7.1f} MB  {ch}  top-1 {row['top1']:.3f}  conversion "
            f"{'ok' if row['conversion']['passes'] else 'FAILS'}  ({row['seconds']} s)",
            flush=True,
        )
        (args.out / "results.json").write_text(json.dumps({"reference": ref_ppl, "plans": results}, indent=1))
    if tool_file is not None:
        results["llama-imatrix file"] = {"expert_tokens": _tool_tokens(tool_file)}
    (args.out / "results.json").write_text(json.dumps({"reference": ref_ppl, "plans": results}, indent=1))
    _print_tokens(results)


def print_table(data: dict[str, Any]) -> None:
    """The README's table: size, perplexity change per domain, top-1 agreement and the conversion check."""
    ref = data["reference"]
    domains = list(ref)
    print(f"| plan | imatrix | GGUF | {' | '.join(domains)} | top-1 vs f32 | conversion check |")
    print("|---|---|---|" + "---|" * len(domains) + "---|---|")
    print(f"| transformers float32 | | | {' | '.join(f'{ref[d]:.2f}' for d in domains)} | | |")
    for name, row in data["plans"].items():
        if "bytes" not in row:
            continue
        conv = row["conversion"]
        check = f"passes ({conv['top1']:.3f})" if conv["passes"] else "fails (" + conv["why"].split(" ")[4] + ")"
        change = " | ".join(f"{100 * row['ppl_change'][d]:+.1f} %" for d in domains)
        print(
            f"| {name} | {row.get('imatrix', '')} | {row['bytes'] / 1e6:.1f} MB | {change} | {row['top1']:.3f} | "
            f"{check} |"
        )


def _types(banks: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for b in banks:
        out.setdefault(b["role"], {}).setdefault(b["type"], 0)
        out[b["role"]][b["type"]] += 1
    return out


def _tool_tokens(path: Path) -> dict[str, dict[str, list[int]]]:
    m = load_imatrix(path)
    return {
        n.split(".")[1]: {"routed": [int(c) for c in e.counts]}
        for n, e in m.entries.items()
        if n.endswith("ffn_gate_exps.weight")
    }


def _print_tokens(results: dict[str, Any]) -> None:
    print("\ntokens per expert (layers 0, 15, 29), fewest over all layers")
    for name, row in results.items():
        tokens = row.get("expert_tokens")
        if not tokens:
            continue
        key = "used" if any("used" in v for v in tokens.values()) else "routed"
        fewest = min(min(v[key]) for v in tokens.values())
        sample = {layer: tokens[layer].get(key) for layer in ("0", "15", "29") if layer in tokens}
        print(f"{name:26} {key:6} fewest {fewest:6}  {sample}")


if __name__ == "__main__":
    sys.exit(main())
