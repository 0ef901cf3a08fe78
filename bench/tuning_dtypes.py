"""Router tuning in bf16 against float32, side by side: step time, tokens/s and peak RSS of `moetool train`'s own
loop (``train_router``) on a size-ladder rung, for each router initialisation.

The rung (default 360M: SmolLM2-360M's shape, random bf16 weights, base + 4 experts, top-2, 1.07B parameters) is
drawn by ``bench/size_ladder.py`` and merged twice, with ``cheap_embed`` and with ``random`` routers. Each
(routers, dtype) run is a process of its own, so its peak RSS is its own; the step times come from the loop's
per-step callback (the first step, which allocates, is reported apart). ``--autocast`` adds the arithmetic a bf16 run
had before: bf16 autocast whatever the CPU (on a CPU without AVX512-BF16 or AMX, PyTorch's fallback bf16 matmul).

    .venv/bin/python bench/tuning_dtypes.py [--rung 360m] [--steps 3] [--batch 2] [--seq 64] [--autocast] [--work DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def _ladder():  # type: ignore[no-untyped-def]
    """bench/size_ladder.py as a module: its rungs, family, texts and recipe."""
    spec = importlib.util.spec_from_file_location("size_ladder", HERE / "size_ladder.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one(moe: Path, recipe: Path, dtype: str, autocast: bool, out: Path) -> None:
    """In a child process: tune ``moe`` in ``dtype``; print one JSON line of step times and the arithmetic."""
    import io

    import torch
    from rich.console import Console

    from moetool.recipe import load_recipe
    from moetool.train import precision
    from moetool.train.router_tuning import train_router

    if autocast:  # the arithmetic before: autocast in the 16-bit dtype on every device
        precision.native_matmul = lambda dtype, device: True  # type: ignore[assignment]
    torch.set_num_threads(os.cpu_count() or 1)
    console = Console(file=io.StringIO(), width=400)
    stamps, cpu = [time.perf_counter()], [time.process_time()]

    def tick(step: int, metrics: object) -> None:
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())

    train_router(load_recipe(recipe), moe, out, force=True, resume=False, dtype=dtype, console=console,
                 callback=tick)  # fmt: skip
    said = console.file.getvalue()  # type: ignore[attr-defined]
    line = next((x for x in said.splitlines() if x.startswith("training in")), "")
    how = "float32 over bf16" if "float32 arithmetic" in line else "bf16 autocast" if "autocast" in line else "float32"
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    cpu_steps = [b - a for a, b in itertools.pairwise(cpu)]
    print(json.dumps({"steps": steps, "cpu": cpu_steps, "arithmetic": how}))


def matmul_probe() -> list[str]:
    """The cause in two lines: a linear layer's backward product (``grad @ W``, both operands contiguous) in float32
    and in bf16 on this CPU, the shape of one attention projection at 128 tokens."""
    import torch

    lines = []
    for m, k, n in ((128, 960, 960), (128, 49152, 960)):  # a projection; the tied head's input gradient
        took = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            torch.mm(a, b)
            t0 = time.perf_counter()
            for _ in range(3):
                torch.mm(a, b)
            took[dtype] = (time.perf_counter() - t0) / 3
        f32, b16 = took[torch.float32], took[torch.bfloat16]
        lines.append(
            f"  [{m}, {k}] @ [{k}, {n}]: float32 {f32 * 1e3:.1f} ms, bf16 {b16 * 1e3:.1f} ms ({b16 / f32:.1f}×)"
        )
    return lines


def _child(args: list[str]) -> tuple[dict[str, object], float, int]:
    """(the child's JSON, its wall seconds, its peak RSS bytes)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    text = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child {args} failed: {text[-500:]}")
    line = [x for x in text.splitlines() if x.startswith("{")][-1]
    return json.loads(line), time.perf_counter() - t0, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rung", default="360m")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--routers", default="random,cheap_embed")
    ap.add_argument("--autocast", action="store_true", help="also the old arithmetic (bf16 autocast everywhere)")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--one", nargs=4, metavar=("MOE", "RECIPE", "DTYPE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        dtype, autocast = args.one[2].removesuffix("+autocast"), args.one[2].endswith("+autocast")
        one(Path(args.one[0]), Path(args.one[1]), dtype, autocast, Path(args.one[3]))
        return
    import torch

    ladder = _ladder()
    work = args.work or Path(tempfile.mkdtemp(prefix="moetool-dtypes-"))
    root = work / args.rung
    base_recipe = ladder.drawn_rung(root, args.rung).read_text()
    cpu = torch.backends.cpu.get_cpu_capability()
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    print(f"CPU: {os.cpu_count()} cores, {cpu}, native bf16 matmul (oneDNN): {native}; load {os.getloadavg()}")
    print("matmul, as a linear layer's backward computes it:", *matmul_probe(), sep="\n")
    print(f"rung {args.rung}, {args.steps} steps of {args.batch} × {args.seq} tokens, mofe preset", flush=True)
    rows = []
    dtypes = ["float32", "bfloat16"] + (["bfloat16+autocast"] if args.autocast else [])
    for routers in args.routers.split(","):
        text = base_recipe.replace("gate_mode: cheap_embed", f"gate_mode: {routers}")
        text = text.replace("steps: 3\n", f"steps: {args.steps}\n").replace("seq_len: 128", f"seq_len: {args.seq}")
        text = text.replace("batch_size: 2\n", f"batch_size: {args.batch}\n")
        recipe = root / f"recipe-{routers}.yaml"
        recipe.write_text(text)
        moe = root / f"moe-{routers}"
        if not (moe / "config.json").is_file():
            subprocess.run([str(BIN / "moetool"), "merge", str(recipe), "-o", str(moe), "--force"], check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
        for dtype in dtypes:
            got, wall, rss = _child(["--one", str(moe), str(recipe), dtype, str(root / "tuned")])
            steps = [float(s) for s in got["steps"]]  # type: ignore[union-attr]
            later = statistics.median(steps[1:]) if len(steps) > 1 else steps[0]
            cpu = [float(s) for s in got["cpu"]]  # type: ignore[union-attr]
            cpu_later = statistics.median(cpu[1:]) if len(cpu) > 1 else cpu[0]
            rows.append((routers, dtype, str(got["arithmetic"]), steps[0], later, cpu_later, wall, rss))
            print(f"  {routers} {dtype} ({got['arithmetic']}): load + first step {steps[0]:.1f} s, then {later:.1f} s/step "
                  f"({cpu_later:.1f} s CPU), peak {rss / 1e9:.2f} "
                  f"GB, whole run {wall:.0f} s", flush=True)  # fmt: skip
            shutil.rmtree(root / "tuned", ignore_errors=True)
    tokens = args.batch * args.seq
    print(f"\nload after: {os.getloadavg()}")
    print("\n| routers | dtype | arithmetic | load + first step | later steps (wall) | tok/s | × float32 | later steps "
          "(CPU) | × float32 (CPU) | peak RSS | whole run |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for routers, dtype, how, first, later, cpu_later, wall, rss in rows:
        ref = next(r for r in rows if r[0] == routers and r[1] == "float32")
        print(f"| {routers} | {dtype} | {how} | {first:.1f} s | {later:.1f} s | {tokens / later:.1f} | "
              f"{ref[4] / later:.2f}× | {cpu_later:.1f} s | {ref[5] / cpu_later:.2f}× | {rss / 1e9:.2f} GB | "
              f"{wall:.0f} s |")  # fmt: skip
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
