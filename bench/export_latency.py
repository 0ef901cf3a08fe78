"""Prefill throughput and per-token decode latency of one MoE in four runtimes on this CPU.

    .venv/bin/python bench/export_latency.py [--model out/demo/tuned-mofe] [--quant f32,q8_0] [--prompt 128]
        [--artifacts DIR]

Exports the model to ONNX, ExecuTorch (XNNPACK), TFLite (LiteRT, run in .venv-litert) and GGUF (llama.cpp), each
without verification (the exporters' tests prove parity), then times in each runtime: a prefill of PROMPT tokens
(tokens/s, median of 5) and 32 decode steps with the KV cache (ms/token, median). Threads: each runtime's default
on this 2-core machine; ``--llama-threads 1`` pins the llama.cpp reference to one thread, whose OpenMP workers
otherwise spin against other processes on a loaded machine. ExecuTorch and LiteRT compute every expert for every token
(dense-masked, the form their exporters write), ONNX either form (``--onnx-moe``) and llama.cpp only the chosen ones,
which is part of what the table shows. An artifact of several chunks (programs or models of consecutive layers) is
timed as an app runs it: every chunk loaded, each step through all of them in turn.

``--artifacts DIR`` keeps the exports in ``DIR/TARGET-QUANT`` and times an export already there instead of writing
it again (any ``moetool export`` output of the same model, target and quant, verified or not): on the 30-layer real
MoE the ExecuTorch export alone takes about 25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STEPS = 32
REPS = 5


def _prefill_decode(prefill, decode, ids: np.ndarray) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    pre = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        _, past = prefill(ids)
        pre.append(ids.shape[1] / (time.perf_counter() - t0))
    step = []
    tok = np.array([[ids[0, -1]]], dtype=np.int64)
    for t in range(STEPS):
        t0 = time.perf_counter()
        _, past = decode(tok, ids.shape[1] + t, past)
        step.append(1000 * (time.perf_counter() - t0))
    return statistics.median(pre), statistics.median(step)


def bench_onnx(d: Path, ids: np.ndarray, n_layers: int) -> tuple[float, float]:
    import json

    from moetool.export.onnx.runner import ort_runners, ort_session

    dec = json.loads((d / "genai_config.json").read_text())["model"]["decoder"]
    prefill, decode = ort_runners(ort_session(d / "model.onnx"), n_layers, dec["num_key_value_heads"], dec["head_size"])
    return _prefill_decode(prefill, decode, ids)


def _chain(runners: list, ids: np.ndarray) -> tuple[float, float]:  # type: ignore[type-arg]
    """Prefill and decode through every chunk of an artifact, all loaded (``graph.chunk.chain_step``)."""
    import torch

    from moetool.export.graph.chunk import chain_step

    def prefill(x):  # type: ignore[no-untyped-def]
        return chain_step(runners, torch.from_numpy(x), 0, None)

    def decode(x, pos, past):  # type: ignore[no-untyped-def]
        return chain_step(runners, torch.from_numpy(x), pos, past)

    return _prefill_decode(prefill, decode, ids)


def bench_executorch(d: Path, ids: np.ndarray) -> tuple[float, float]:
    """The runner program (its ``forward(tokens, input_pos)``, the cache inside, as TextLLMRunner calls it), or a
    chain's programs in order (``programs`` in the manifest: one per chunk of layers), all loaded."""
    import torch

    from moetool.export.executorch.exporter import program_runner

    man = json.loads((d / "manifest.json").read_text())
    first = man["programs"][0]
    if "data" in first:
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(str(d / first["file"]), data_path=str(d / first["data"]))
        forward = program.load_method("forward")

        def prefill(x):  # type: ignore[no-untyped-def]
            return forward.execute([torch.from_numpy(x), torch.tensor([0])]), None

        def decode(x, pos, past):  # type: ignore[no-untyped-def]
            return forward.execute([torch.from_numpy(x), torch.tensor([pos])]), None

        return _prefill_decode(prefill, decode, ids)
    return _chain([program_runner(d / c["file"]) for c in man["programs"]], ids)


def bench_tflite(d: Path, ids: np.ndarray) -> tuple[float, float]:
    """Runs in the LiteRT venv (this script re-invoked with --litert): the models in order (``chunks``), all loaded,
    the prompt cut to the converted prefill length."""
    from moetool.export.tflite.chain_worker import chunk_runner

    man = json.loads((d / "manifest.json").read_text())
    cap, plen = man["capacity"], man["prefill_len"]
    return _chain([chunk_runner(d / c["file"], cap, plen) for c in man["chunks"]], ids[:, :plen])


def bench_gguf(path: Path, ids: np.ndarray, threads: int | None) -> tuple[float, float]:
    from moetool.export.gguf.verify import load_llama

    llm = load_llama(path, n_ctx=ids.shape[1] + STEPS + 8, n_threads=threads)
    toks = [int(t) for t in ids[0]]

    def prefill(x):  # type: ignore[no-untyped-def]
        llm.reset()
        llm.eval(toks)
        return None, None

    def decode(x, pos, past):  # type: ignore[no-untyped-def]
        llm.eval([int(x[0, 0])])
        return None, None

    try:
        return _prefill_decode(prefill, decode, ids)
    finally:
        llm.close()


def reusable(out: Path, model: Path, target: str, quant: str, options: dict) -> dict | None:
    """The manifest of a finished export of ``model`` at ``out`` for this target, quant and ONNX MoE kernel."""
    try:
        man: dict = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    kernel = {"sparse": "sparse", "dense": "dense-masked"}.get(options.get("moe_kernel", ""))
    same = (
        man.get("target") == target
        and man.get("plan", {}).get("label") == quant
        and Path(man.get("model", {}).get("path", "")).resolve() == model.resolve()
        and (kernel is None or man.get("moe_kernel", {}).get("kind") == kernel)
    )
    if not same:
        print(f"{out}: not an export of {model} to {target} at {quant}; exporting again")
        return None
    print(f"{out}: timing the existing export")
    return man


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quant", default="f32,q8_0")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--targets", default="onnx,executorch,tflite,gguf", help="gguf (llama.cpp) is the reference")
    ap.add_argument("--onnx-moe", default="sparse,dense", help="ONNX MoE kernels to time (--moe-kernel)")
    ap.add_argument("--llama-threads", type=int, default=None, help="llama.cpp threads (default: cores, at most 4)")
    ap.add_argument("--artifacts", default=None, help="keep exports here and time the ones already there")
    ap.add_argument("--litert", default=None, help=argparse.SUPPRESS)  # internal: DIR, run in the LiteRT venv
    args = ap.parse_args()
    ids = (np.arange(args.prompt, dtype=np.int64)[None] * 7 + 11) % 1000 + 4
    if args.litert:
        print(json.dumps(bench_tflite(Path(args.litert), ids)))
        return
    from moetool.api import export
    from moetool.export.tflite.exporter import litert_python

    model = Path(args.model or ("out/demo/tuned-mofe" if Path("out/demo/tuned-mofe").is_dir() else "out/demo/merged"))
    cfg = json.loads((model / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    print(f"model {model} | prompt {args.prompt} tokens, {STEPS} decode steps | medians\n")
    print(f"{'runtime':22} {'plan':6} {'prefill tok/s':>14} {'decode ms/token':>16} {'artifact MB':>12}")
    with tempfile.TemporaryDirectory(prefix="moetool-lat-") as scratch:
        tmp = args.artifacts or scratch
        for q in args.quant.split(","):
            rows = []
            runs = [
                (f"onnx-{k}" if t == "onnx" else t, t, {"moe_kernel": k} if t == "onnx" else {})
                for t in args.targets.split(",")
                for k in (args.onnx_moe.split(",") if t == "onnx" else [""])
            ]
            if "gguf" not in args.targets.split(","):
                runs.append(("gguf", "gguf", {}))
            for label, target, options in runs:
                out = Path(tmp) / f"{label}-{q}"
                man = reusable(out, model, target, q, options) or export(
                    model, out, target=target, quant=q, verify=False, options=options, force=True
                )
                if target == "onnx":
                    res = bench_onnx(out, ids, n_layers)
                elif target == "executorch":
                    res = bench_executorch(out, ids)
                elif target == "tflite":
                    proc = subprocess.run(
                        [litert_python(), __file__, "--litert", str(out), "--prompt", str(args.prompt)],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    res = tuple(json.loads(proc.stdout.strip().splitlines()[-1]))
                else:
                    res = bench_gguf(out / man["file"], ids, args.llama_threads)
                rows.append((label, res, man["artifact"]["bytes"]))
                print(f"{label:22} {q:6} {res[0]:14.0f} {res[1]:16.2f} {man['artifact']['bytes'] / 1e6:12.2f}")
            base = next(r for r in rows if r[0] == "gguf")
            for target, res, _ in rows:
                print(
                    f"  {target}: prefill {res[0] / base[1][0]:.2f}× llama.cpp, decode latency {res[1] / base[1][1]:.2f}× llama.cpp"
                )
            print()


if __name__ == "__main__":
    sys.exit(main())
