"""Benchmark: a merge whose inputs are larger than this machine's memory.

A base and four experts in the shape of Llama-3.2-3B (``bench/size_ladder.py``'s ``3b`` shape, SmolLM2's
vocabulary: 2.97B parameters, 5.9 GB each in bf16, 29.7 GB in all) merge into a top-2 Mixtral of 9.4B parameters
(18.6 GB) with random routers. Each tool runs as its own process (peak RSS from ``wait4``), one after the other in
the same run as the I/O floor: reading the bytes any such merge must read (the base whole, each expert's MLP) and
writing and fsyncing the MoE's bytes. The inputs do not all fit in the page cache. moetool runs twice: first with an
empty cache, so it also hashes every input file for the provenance record (a second full read, on the other core),
then again with those hashes cached, as a repeated merge of the same inputs runs.

    .venv/bin/python bench/larger_than_ram.py [--shape 3b] [--work DIR] [--reps 1] [--no-mergekit] [--keep]

mergekit-moe (``bash scripts/setup.sh --bench``) runs on the same family and gate mode when it is installed; the
table says how it ended. Only one output is on disk at a time (the family plus one MoE need about 50 GB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import merge_vs_mergekit as mvm
import size_ladder as sl

_FLOOR = """
import json, os, struct, sys, time
plan, out_bytes, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t0 = time.perf_counter()
buf = bytearray(64 << 20)
view = memoryview(buf)
for path, ranges in plan:
    with open(path, "rb", buffering=0) as fh:
        for start, length in ranges:
            fh.seek(start)
            while length > 0:
                n = fh.readinto(view[: min(length, len(buf))])
                length -= n
with open(out, "wb", buffering=0) as fh:
    left = out_bytes
    while left > 0:
        left -= fh.write(view[: min(left, len(buf))])
    os.fsync(fh.fileno())
os.unlink(out)
print(time.perf_counter() - t0)
"""


def _ranges(path: Path, keep: object) -> list[tuple[int, int]]:
    """Byte ranges of the tensors of ``path`` (one safetensors file) whose names ``keep`` accepts, merged."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    spans = sorted(
        (8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
        for k, v in header.items()
        if k != "__metadata__" and keep(k)  # type: ignore[operator]
    )
    merged: list[tuple[int, int]] = []
    for start, length in spans:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return merged


def io_floor(paths: dict[str, Path], out_bytes: int, scratch: Path) -> tuple[float, int]:
    """Seconds to read what the merge needs (the base whole, each expert's MLP tensors) and write and fsync
    ``out_bytes``; and the bytes read."""
    plan = [[str(f), _ranges(f, lambda k: True)] for f in sorted(paths["base"].glob("*.safetensors"))]
    for e in sl.EXPERTS:
        plan += [[str(f), _ranges(f, lambda k: ".mlp." in k)] for f in sorted(paths[e].glob("*.safetensors"))]
    read = sum(length for _, ranges in plan for _, length in ranges)
    cmd = [sys.executable, "-S", "-c", _FLOOR, json.dumps(plan), str(out_bytes), str(scratch)]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout), read


def configs(root: Path, paths: dict[str, Path]) -> tuple[Path, Path]:
    """The same MoE as a moetool recipe and a mergekit-moe config: top-2 of the four experts, random routers, bf16."""
    mt = ["name: ltr", "method: mofe", f"base_model: {paths['base']}", "gate_mode: random", "dtype: bfloat16",
          "experts_per_token: 2", "experts:"] + [f"  - {{name: {e}, source: {paths[e]}}}" for e in sl.EXPERTS]  # fmt: skip
    mk = [f"base_model: {paths['base']}", "gate_mode: random", "dtype: bfloat16", "experts_per_token: 2",
          "experts:"] + [f"  - source_model: {paths[e]}" for e in sl.EXPERTS]  # fmt: skip
    (root / "moetool.yaml").write_text("\n".join(mt) + "\n")
    (root / "mergekit.yml").write_text("\n".join(mk) + "\n")
    return root / "moetool.yaml", root / "mergekit.yml"


def _tool(cmd: list[str], out: Path) -> tuple[float, float, int, str]:
    """(wall s, peak RSS MB, output bytes, how it ended) of one tool's merge; the output is removed after."""
    try:
        wall, rss = mvm.run(cmd)
        ended = "ok"
    except RuntimeError as exc:
        wall, rss, ended = float("nan"), float("nan"), str(exc).strip().splitlines()[-1][:120]
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) if out.is_dir() else 0
    shutil.rmtree(out, ignore_errors=True)
    return wall, rss, size, ended


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="3b", choices=sorted(sl.RUNGS))
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the family")
    args = ap.parse_args()
    mergekit = None if args.no_mergekit else shutil.which("mergekit-moe", path=str(mvm.ROOT / ".venv-mergekit/bin"))
    work = args.work or Path(tempfile.mkdtemp(prefix="moetool-ltr-"))
    work.mkdir(parents=True, exist_ok=True)
    models = work / "models"
    if not (models / sl.EXPERTS[-1] / "config.json").is_file():  # the family is drawn once, in its own process
        subprocess.run([sys.executable, sl.__file__, "--family", args.shape, str(models)], check=True)
    paths = {n: models / n for n in ("base", *sl.EXPERTS)}
    inputs = sum(f.stat().st_size for p in paths.values() for f in p.glob("*.safetensors"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"inputs: base + {len(sl.EXPERTS)} experts, {inputs / 1e9:.1f} GB of bf16; memory {ram / 1e9:.1f} GB; "
          f"{os.cpu_count()} CPUs", flush=True)  # fmt: skip
    mt_cfg, mk_cfg = configs(work, paths)
    first, again = "moetool, first merge (hashes every input)", "moetool, again (input hashes cached)"
    runs: dict[str, list[tuple[float, float, int, str]]] = {first: [], again: [], "floor": [], "mergekit-moe": []}
    out_bytes = 0
    cache = work / "cache"
    os.environ["MOETOOL_CACHE"] = str(cache)  # the provenance hashes' cache: emptied before each first merge
    for _ in range(args.reps):
        cmd = [str(sl.BIN / "moetool"), "merge", str(mt_cfg), "-o", str(work / "mt-out"), "--force"]
        shutil.rmtree(cache, ignore_errors=True)
        for label in (first, again):
            runs[label].append(r := _tool(cmd, work / "mt-out"))
            out_bytes = r[2] or out_bytes
            print(f"  {label}: {r[0]:.1f} s, peak {r[1]:.0f} MB, {r[3]}", flush=True)
        wall, read = io_floor(paths, out_bytes, work / "floor.bin")
        runs["floor"].append(
            (wall, float("nan"), out_bytes, f"read {read / 1e9:.1f} GB, wrote {out_bytes / 1e9:.1f} GB")
        )
        print(f"  floor: {wall:.1f} s ({runs['floor'][-1][3]})", flush=True)
        if mergekit:
            cmd = [mergekit, str(mk_cfg), str(work / "mk-out"), "--random-seed", "0"]
            runs["mergekit-moe"].append(r := _tool(cmd, work / "mk-out"))
            print(f"  mergekit-moe: {r[0]:.1f} s, peak {r[1]:.0f} MB, {r[3]}", flush=True)
    floor = statistics.median(w for w, *_ in runs["floor"])
    print("\n| tool | wall | peak RSS | ÷ I/O floor | output | result |\n|---|---|---|---|---|---|")
    for tool, rs in runs.items():
        if not rs:
            why = "not run (--no-mergekit)" if args.no_mergekit else "not installed (bash scripts/setup.sh --bench)"
            print(f"| {tool} | - | - | - | - | {why} |")
            continue
        wall = statistics.median(r[0] for r in rs)
        rss = max(r[1] for r in rs)
        rss_s = "-" if math.isnan(rss) else f"{rss / 1e3:.2f} GB"
        print(f"| {tool} | {wall:.0f} s | {rss_s} | {wall / floor:.2f}× | {rs[-1][2] / 1e9:.1f} GB | {rs[-1][3]} |")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
