"""Where llama.cpp's MoE prefill goes: the MoE's GGUF against its dense expert and two controls built from it.

    .venv/bin/python bench/gguf_moe_prefill.py [--model out/demo/tuned-mofe] [--dense smollm2-code] [--quant q8_0 --quant q4_0]

Exports the MoE and the dense expert (``--gguf-dir`` keeps them for the next run), then derives by GGUF surgery, on
the files' own quantized bytes:

- ``dense-wide``: the dense model with its FFN top_k times as wide (the MoE's active shape), the added units zero;
- ``wide-as-moe1``: that FFN written as a MoE of one expert (top-1): the same arithmetic, but through llama.cpp's
  MUL_MAT_ID instead of MUL_MAT (both controls compute the dense model's function: their logits are compared with
  its logits here);
- ``moe-k-of-k``: the MoE cut to its first top_k experts, so every token goes to every expert (no row split).

llama.cpp repacks (CPU_REPACK, q4_0 and others) expert banks of two or more experts but not a bank of one, so at
such types ``wide-as-moe1`` shows the plain vec_dot path and ``moe-k-of-k`` is the control for the MoE's kernel.

Prefill and decode tokens/s are timed interleaved (median of ``--reps``). With ``--threads 1`` (the default) the clock
is the thread's CPU time, which other processes on a shared machine do not enter; with more threads it is wall time.
The prefill ceiling is the dense model's multiply-adds per prompt token over the MoE's (weights, top-k of each expert
bank, attention over the prompt, the head once for the last position); the decode ceiling is bytes read per token.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

FFN = ("ffn_gate", "ffn_up", "ffn_down")


def _kv(path: Path) -> tuple[Any, str, dict[str, Any]]:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = str(r.fields["general.architecture"].contents())
    kv = {name: f.contents() for name, f in r.fields.items() if not name.startswith("GGUF.")}
    return r, arch, kv


def rewrite(
    src: Path,
    dst: Path,
    kv_over: dict[str, int],
    tensor: Callable[[str, np.ndarray], list[tuple[str, np.ndarray]]],
) -> Path:
    """Copy ``src`` to ``dst`` with metadata overrides; ``tensor(name, data)`` maps each tensor to what is written
    in its place (``data`` in the reader's byte layout: quantized rows stay whole blocks, so rows can be repeated,
    concatenated or dropped without requantizing)."""
    from gguf import GGUFValueType, GGUFWriter

    r, arch, _ = _kv(src)
    w = GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in kv_over:
            continue
        w.add_key_value(name, f.contents(), f.types[0], f.types[1] if f.types[0] == GGUFValueType.ARRAY else None)
    for name, val in kv_over.items():
        w.add_key_value(name, val, GGUFValueType.UINT32)
    for t in r.tensors:
        for name, data in tensor(t.name, np.asarray(t.data)):
            raw_type = t.tensor_type if data.dtype == np.uint8 else None
            w.add_tensor(name, np.ascontiguousarray(data), raw_shape=list(data.shape), raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def widen(dense: Path, dst: Path, k: int) -> Path:
    """The dense FFN ``k`` times as wide, computing the same function: gate rows and down columns repeated, the
    added up rows zero (all-zero bytes are zero in every block format), so the extra units add exactly 0 and the
    model stays the dense one (its logits are the check) at the MoE's active cost."""
    _, arch, kv = _kv(dense)

    def t(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
        if name.endswith("ffn_gate.weight"):
            return [(name, np.concatenate([data] * k, axis=0))]
        if name.endswith("ffn_up.weight"):
            return [(name, np.concatenate([data] + [np.zeros_like(data)] * (k - 1), axis=0))]
        if name.endswith("ffn_down.weight"):
            return [(name, np.concatenate([data] * k, axis=1))]
        return [(name, data)]

    return rewrite(dense, dst, {f"{arch}.feed_forward_length": int(kv[f"{arch}.feed_forward_length"]) * k}, t)


def as_one_expert(dense: Path, dst: Path) -> Path:
    """The dense FFN as a MoE of one expert: a zero router (softmax of one logit is 1) and ``*_exps`` banks of one."""
    _, arch, kv = _kv(dense)
    hidden = int(kv[f"{arch}.embedding_length"])

    def t(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
        for p in FFN:
            if name.endswith(f"{p}.weight"):
                out = [(name.replace(f"{p}.weight", f"{p}_exps.weight"), data[None])]
                if p == "ffn_gate":
                    out.append((name.replace("ffn_gate", "ffn_gate_inp"), np.zeros((1, hidden), np.float32)))
                return out
        return [(name, data)]

    return rewrite(dense, dst, {f"{arch}.expert_count": 1, f"{arch}.expert_used_count": 1}, t)


def first_experts(moe: Path, dst: Path, k: int) -> Path:
    """The MoE cut to its first ``k`` experts with top-k = k: every token goes to every expert."""
    _, arch, _ = _kv(moe)

    def t(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
        return [(name, data[:k] if "_exps" in name or "ffn_gate_inp" in name else data)]

    return rewrite(moe, dst, {f"{arch}.expert_count": k, f"{arch}.expert_used_count": k}, t)


def prefill_macs(path: Path, n: int) -> float:
    """Multiply-adds per token of an ``n``-token prefill: every matrix once (an expert bank top-k/E of it), the
    attention over the causal prompt (average context (n+1)/2), the head once for the last position."""
    r, arch, kv = _kv(path)
    top_k = int(kv.get(f"{arch}.expert_used_count", 1))
    names = {t.name for t in r.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    macs = 0.0
    for t in r.tensors:
        if len(t.shape) < 2 or (t.name == "token_embd.weight" and head != t.name):
            continue
        m = float(np.prod([int(x) for x in t.shape[:2]]))
        macs += m / n if t.name == head else m * (top_k if "_exps" in t.name else 1)
    q_dim = int(kv[f"{arch}.attention.head_count"]) * int(kv[f"{arch}.rope.dimension_count"])
    return macs + int(kv[f"{arch}.block_count"]) * 2 * q_dim * (n + 1) / 2


def decode_bytes(path: Path) -> float:
    """Bytes a decode step reads: every tensor once, an expert bank top-k/E of it, a tied embedding as the head."""
    r, arch, kv = _kv(path)
    top_k, experts = int(kv.get(f"{arch}.expert_used_count", 1)), int(kv.get(f"{arch}.expert_count", 1))
    tied = not any(t.name == "output.weight" for t in r.tensors)
    total = 0.0
    for t in r.tensors:
        if t.name == "token_embd.weight" and not tied:
            continue
        total += int(t.n_bytes) * (top_k / experts if "_exps" in t.name else 1)
    return total


def _load(path: Path, n_ctx: int, threads: int, logits_all: bool = False) -> Any:
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=min(n_ctx, 512),
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )


def agreement(a: Path, b: Path, ids: list[int]) -> tuple[float, float]:
    """(max |logit difference|, share of positions with the same top-1 token) of two GGUFs on ``ids``."""
    out = []
    for p in (a, b):
        llm = _load(p, len(ids) + 8, 1, logits_all=True)
        llm.eval(ids)
        out.append(np.array(llm.scores[: len(ids)]))
        llm.close()
    same = float((out[0].argmax(-1) == out[1].argmax(-1)).mean())
    return float(np.abs(out[0] - out[1]).max()), same


def timed(paths: list[Path], prompt: list[int], gen: int, reps: int, threads: int) -> list[tuple[float, float]]:
    """(prefill, decode) tokens/s of each GGUF, medians of ``reps``, the models taking turns so drift hits all."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    llms = [_load(p, len(prompt) + gen + 8, threads) for p in paths]
    pre: list[list[float]] = [[] for _ in paths]
    dec: list[list[float]] = [[] for _ in paths]
    for rep in range(reps + 1):  # the first round warms caches and page mappings, not counted
        for i, llm in enumerate(llms):
            llm.reset()
            t0 = clock()
            llm.eval(prompt)
            t1 = clock()
            for j in range(gen):
                llm.eval([prompt[1 + j]])
            t2 = clock()
            if rep:
                pre[i].append(len(prompt) / (t1 - t0))
                dec[i].append(gen / (t2 - t1))
    for llm in llms:
        llm.close()
    return [(statistics.median(p), statistics.median(d)) for p, d in zip(pre, dec, strict=True)]


def artifacts(moe: Path, dense: Path, quant: str, cache: Path, tmp: Path) -> dict[str, Path]:
    """The MoE and dense GGUFs (exported once into ``cache``) and the three controls (in ``tmp``)."""
    from moetool.api import export

    files = {}
    slug = re.sub(r"[^A-Za-z0-9_]+", "-", quant)
    for tag, src in (("moe", moe), ("dense", dense)):
        f = cache / f"{tag}-{slug}.gguf"
        if not f.is_file():
            m = export(src, tmp / f"{tag}-{slug}", quant=quant, verify=False)
            os.replace(tmp / f"{tag}-{slug}" / m["file"], f)
        files[tag] = f
    _, arch, mkv = _kv(files["moe"])
    _, darch, dkv = _kv(files["dense"])
    top_k = int(mkv[f"{arch}.expert_used_count"])
    wide, rest = divmod(top_k * int(mkv[f"{arch}.feed_forward_length"]), int(dkv[f"{darch}.feed_forward_length"]))
    if rest:
        sys.exit(f"the MoE's active FFN width (top-{top_k} experts) is not a multiple of the dense model's")
    files["dense-wide"] = widen(files["dense"], tmp / f"wide-{slug}.gguf", wide)
    files["wide-as-moe1"] = as_one_expert(files["dense-wide"], tmp / f"wide-moe1-{slug}.gguf")
    files["moe-k-of-k"] = first_experts(files["moe"], tmp / f"k-of-k-{slug}.gguf", top_k)
    return files


def report(quant: str, files: dict[str, Path], speeds: dict[str, tuple[float, float]], n: int) -> None:
    d_pre, d_dec = speeds["dense"]
    pre_ceil = prefill_macs(files["dense"], n) / prefill_macs(files["moe"], n)
    dec_ceil = decode_bytes(files["dense"]) / decode_bytes(files["moe"])
    r, _, _ = _kv(files["moe"])
    banks = sorted({f"{t.name.split('.')[-2]} {t.tensor_type.name}" for t in r.tensors if "_exps" in t.name})
    print(f"\n{quant}: prefill ceiling {pre_ceil:.3f} (multiply-adds), decode ceiling {dec_ceil:.3f} (bytes)")
    print(f"expert banks: {', '.join(banks)}")
    # every row but the dense one has the MoE's active shape, so the MoE's ceilings apply to it
    head = f"{'model':14} {'prefill tok/s':>13} {'/dense':>7} {'/ceiling':>9} {'decode tok/s':>13} {'/dense':>7}"
    print(head + f" {'/ceiling':>9}")
    for tag in ("dense", "dense-wide", "wide-as-moe1", "moe-k-of-k", "moe"):
        p, d = speeds[tag]
        pc, dc = ("-", "-") if tag == "dense" else (f"{p / d_pre / pre_ceil:.3f}", f"{d / d_dec / dec_ceil:.3f}")
        print(f"{tag:14} {p:13.1f} {p / d_pre:7.3f} {pc:>9} {d:13.1f} {d / d_dec:7.3f} {dc:>9}")
    s = {k: v[0] for k, v in speeds.items()}
    print(
        f"MoE/dense prefill {s['moe'] / s['dense']:.3f} = more weights {s['dense-wide'] / s['dense']:.3f}"
        f" × MUL_MAT_ID and routing {s['moe-k-of-k'] / s['dense-wide']:.3f}"
        f" × row split over experts {s['moe'] / s['moe-k-of-k']:.3f};"
        f" the same FFN through MUL_MAT_ID alone: {s['wide-as-moe1'] / s['dense-wide']:.3f} of MUL_MAT"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="out/demo/tuned-mofe", help="the MoE (a Mixtral-style folder)")
    ap.add_argument("--dense", default="smollm2-code", help="the dense expert: a zoo name or a folder")
    ap.add_argument(
        "--quant",
        action="append",
        help="a plan for both models, repeatable (default q8_0 and q4_0); rules work too: "
        "'experts=q6_k,ffn=q6_k,*=q8_0' puts the FFN banks of both at q6_k where rows allow",
    )
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens of the prefill")
    ap.add_argument("--gen", type=int, default=32, help="decode steps after the prefill")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="1: thread CPU time (load-proof); more: wall time")
    ap.add_argument("--gguf-dir", default="out/bench/gguf-moe-prefill", help="keeps the exports between runs")
    args = ap.parse_args()
    from moetool.zoo import resolve_zoo_model

    moe = Path(args.model)
    if not (moe / "config.json").is_file():
        sys.exit(f"--model {moe}: no config.json there; run `moetool demo` first or pass a MoE folder")
    dense = Path(args.dense) if Path(args.dense).is_dir() else resolve_zoo_model(args.dense)
    cache = Path(args.gguf_dir)
    cache.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    prompt = [1, *(int(x) for x in rng.integers(100, 40000, args.prompt + args.gen))]
    clock = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"MoE {moe} vs dense {args.dense}; llama.cpp via llama-cpp-python, {args.threads} thread(s), {clock};")
    print(f"prompt {args.prompt} tokens, {args.gen} decode steps, median of {args.reps}; load {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="moetool-prefill-") as tmp:
        for q in args.quant or ["q8_0", "q4_0"]:
            files = artifacts(moe, dense, q, cache, Path(tmp))
            for tag in ("dense-wide", "wide-as-moe1"):
                diff, top1 = agreement(files["dense"], files[tag], prompt[:64])
                print(f"{q} {tag} vs dense: max |Δlogit| {diff:.3g}, top-1 agreement {top1:.3f}")
                # another kernel rounds differently (q4_0: repacked gemm against plain vec_dot flips ~10 % of top-1
                # tokens on a random prompt, whose top-2 are close); a broken control agrees on almost none
                if top1 < 0.5:
                    sys.exit(f"{q}: the {tag} control does not compute the dense model's function; no report")
            tags = list(files)
            measured = timed([files[t] for t in tags], prompt[: args.prompt], args.gen, args.reps, args.threads)
            report(q, files, dict(zip(tags, measured, strict=True)), args.prompt)
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
