"""Router tuning sharded with FSDP2 over 1, 2 and 4 CPU processes against one process and against DDP: the peak
resident memory of each process, as ``moetool train`` records it in the tuned model's ``moetool.json``.

The rung (default 360M: SmolLM2-360M's shape, random bf16 weights, base + 4 experts, top-2, 1.07B parameters,
2.14 GB) is drawn by ``bench/size_ladder.py`` and merged once. Every run tunes it in bf16 for the same global batch
(``grad_accum`` micro-batches, split over the processes) under ``accelerate launch`` with
``examples/accelerate/fsdp_cpu.yaml`` (FSDP2) or ``cpu_multi_process.yaml`` (DDP), and the routers of every run are
compared with the one-process run's.

    .venv/bin/python bench/sharded_tuning.py [--rung 360m] [--processes 1,2,4] [--steps 2] [--work DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
CONFIGS = ROOT / "examples" / "accelerate"


def _ladder():  # type: ignore[no-untyped-def]
    """bench/size_ladder.py as a module: its rungs, family, texts and recipe."""
    spec = importlib.util.spec_from_file_location("size_ladder", HERE / "size_ladder.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tune(layout: str, n: int, moe: Path, recipe: Path, out: Path, log: Path) -> tuple[float, dict[str, object]]:
    """One ``moetool train`` run; (wall seconds, the ``training`` record of its output)."""
    train = ["train", str(recipe), "--model", str(moe), "-o", str(out), "--force", "--no-resume", "--dtype", "bfloat16"]
    if layout == "single":
        cmd = [str(BIN / "moetool"), *train]
    else:
        config = CONFIGS / ("fsdp_cpu.yaml" if layout == "fsdp2" else "cpu_multi_process.yaml")
        cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(config), "--num_processes", str(n)]
        cmd += ["--main_process_port", str(29500 + n), "--no_python", str(BIN / "moetool"), *train]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    t0 = time.perf_counter()
    with log.open("w") as fh:
        subprocess.run(cmd, check=True, env=env, stdout=fh, stderr=subprocess.STDOUT)
    record = json.loads((out / "moetool.json").read_text())["training"]
    return time.perf_counter() - t0, record


def _router_diff(a: Path, b: Path) -> float:
    from safetensors import safe_open

    def routers(p: Path) -> dict[str, object]:
        out = {}
        for f in sorted(p.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out |= {k: h.get_tensor(k).float() for k in h.keys() if k.endswith("gate.weight")}  # noqa: SIM118
        return out

    ra, rb = routers(a), routers(b)
    return max(float((ra[k] - rb[k]).abs().max()) for k in ra)  # type: ignore[operator]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rung", default="360m")
    ap.add_argument("--processes", default="1,2,4")
    ap.add_argument("--ddp", default="2", help="process counts to run data-parallel too, for contrast")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    ladder = _ladder()
    work = args.work or Path(tempfile.mkdtemp(prefix="moetool-sharded-"))
    root = work / args.rung
    text = ladder.drawn_rung(root, args.rung).read_text()
    # the same global batch for every process count: 4 micro-batches of one row
    text = text.replace("steps: 3\n", f"steps: {args.steps}\n").replace("seq_len: 128", f"seq_len: {args.seq}")
    text = text.replace("batch_size: 2\n", "batch_size: 1\n  grad_accum: 4\n")
    recipe = root / "recipe-sharded.yaml"
    recipe.write_text(text)
    moe = root / "moe"
    if not (moe / "config.json").is_file():
        subprocess.run([str(BIN / "moetool"), "merge", str(recipe), "-o", str(moe), "--force"], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    weights = sum(f.stat().st_size for f in moe.glob("*.safetensors"))
    print(f"rung {args.rung}: MoE {weights / 1e9:.2f} GB bf16; {args.steps} steps of 4 × 1 × {args.seq} tokens, mofe")
    runs = [("single", 1)] + [("fsdp2", int(n)) for n in args.processes.split(",") if n]
    runs += [("ddp", int(n)) for n in args.ddp.split(",") if n]
    rows = []
    for layout, n in runs:
        out = root / f"tuned-{layout}-{n}"
        wall, record = _tune(layout, n, moe, recipe, out, root / f"log-{layout}-{n}.txt")
        peaks = [float(x) for x in record["peak_rss_gb"]]  # type: ignore[union-attr]
        diff = _router_diff(root / "tuned-single-1", out)
        rows.append((layout, n, wall, peaks, diff))
        print(f"  {layout} × {n}: {wall:.0f} s, peak per process {', '.join(f'{p:.2f}' for p in peaks)} GB, "
              f"max |Δ router| vs one process {diff:.2g}", flush=True)  # fmt: skip
        if layout != "single":
            shutil.rmtree(out, ignore_errors=True)
    print("\n| layout | processes | wall | peak per process (max) | sum over processes | × MoE bf16 bytes (max) | "
          "max abs Δ router vs 1 process |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for layout, n, wall, peaks, diff in rows:
        print(f"| {layout} | {n} | {wall:.0f} s | {max(peaks):.2f} GB | {sum(peaks):.2f} GB | "
              f"{max(peaks) * 1e9 / weights:.2f}× | {diff:.2g} |")  # fmt: skip
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
