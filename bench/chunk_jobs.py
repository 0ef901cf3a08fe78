"""Chunks converted one at a time against several at once (``--jobs``) for the chunked graph targets (Core ML,
ExecuTorch, TFLite): wall time, peak memory summed over the process tree and the ratio, in one run, and whether the
artifacts' files are byte for byte the same.

    .venv/bin/python bench/chunk_jobs.py MODEL [--targets tflite,executorch,coreml] [--quant moe-q4] [--jobs N]
        [--verify] [--work DIR]

MODEL is any exportable MoE folder (the size ladder's rungs: ``bench/size_ladder.py --keep``). Without ``--verify``
the exports skip their check, so the figures are the conversions'. ``--jobs`` is the "several" side (default 0: the
exporter's own choice, as many as the cores and the memory allow); the exports alternate, one at a time first.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import size_ladder as sl  # measured(): wall and peak over the process tree


def export(model: Path, target: str, out: Path, quant: str, jobs: int, verify: bool) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, jobs the exporter ran) of one export of ``model`` to ``target``."""
    args = [str(sl.BIN / "moetool"), "export", str(model), "-o", str(out), "--target", target, "--quant", quant]
    args += ["--force"] + (["--jobs", str(jobs)] if jobs else []) + ([] if verify else ["--no-verify"])
    wall, rss, _, code, last = sl.measured(args, out.with_suffix(".log"))
    if code != 0:
        raise SystemExit(f"{target} export failed ({code}): {last}")
    return wall, rss, str(json.loads((out / "manifest.json").read_text())["jobs"])


def same_files(a: Path, b: Path) -> bool:
    """Whether every artifact file (the manifests aside: they carry timings) is byte for byte the same."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name != "manifest.json")
    return all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--targets", default="tflite,executorch,coreml")
    ap.add_argument("--quant", default="moe-q4")
    ap.add_argument("--jobs", type=int, default=0, help="chunks at once on the 'several' side (0: the default)")
    ap.add_argument("--verify", action="store_true", help="run each export's check too")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="chunk-jobs-"))
    print("| target | one at a time: wall, peak | several: jobs, wall, peak | wall ratio | same files |")
    print("|---|---|---|---|---|")
    for target in args.targets.split(","):
        one, several = work / f"{target}-1", work / f"{target}-n"
        w1, p1, _ = export(args.model, target, one, args.quant, 1, args.verify)
        wn, pn, jobs = export(args.model, target, several, args.quant, args.jobs, args.verify)
        same = same_files(one, several)
        print(
            f"| {target} | {w1:.0f} s, {p1 / 1e9:.2f} GB | {jobs}, {wn:.0f} s, {pn / 1e9:.2f} GB | "
            f"{w1 / wn:.2f}x | {'yes' if same else 'no'} |",
            flush=True,
        )
        shutil.rmtree(one), shutil.rmtree(several)


if __name__ == "__main__":
    main()
