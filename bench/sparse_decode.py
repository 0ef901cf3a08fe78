"""Decode time per token of an MoE's sparse ONNX graph (onnxruntime's QMoE: only the top-2 experts run) against its
dense-masked graph (every expert runs), the ExecuTorch and LiteRT artifacts (dense-masked: the form their exporters
write, ``moe_kernel.reason`` in their manifests says why) and llama.cpp, all at 4-bit experts (``--quant moe-q4``),
at 4 and 8 experts.

Each family is the size ladder's 360M shape (random bf16 weights; timing depends on shapes only): a base and N
experts drawn in a child process, merged top-2, then ``bench/export_latency.py --targets TARGETS --onnx-moe
sparse,dense`` exports and times it in the same run (prefill of 128 tokens, 32 decode steps, medians). With
``--work DIR --keep`` a second run times the exports already there (the ExecuTorch one takes most of an hour at
8 experts on 2 cores), so the timings can be taken on an idle machine.

    .venv/bin/python bench/sparse_decode.py [--experts 4,8] [--targets onnx,executorch,tflite,gguf] [--work DIR]
        [--keep] [--llama-threads N]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import size_ladder as sl  # the ladder's family, texts and recipe

NAMES = ("code", "legal", "medical", "math", "e5", "e6", "e7", "e8")


def family(n: int, root: Path) -> Path:
    """Draw (in a child process) and merge a 360M-shaped family of ``n`` experts under ``root``; the MoE's path."""
    sl.EXPERTS = NAMES[:n]
    if not (root / "models" / sl.EXPERTS[-1] / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--draw", str(n), str(root / "models")], check=True)
    paths = {name: root / "models" / name for name in ("base", *sl.EXPERTS)}
    recipe = sl._recipe(root, paths, sl._texts(root))
    moe = root / "moe"
    if not (moe / "config.json").is_file():
        subprocess.run([str(sl.BIN / "moetool"), "merge", str(recipe), "-o", str(moe), "--force"], check=True)
    return moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", default="4,8")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--targets", default="onnx,executorch,tflite,gguf", help="gguf (llama.cpp) is the reference")
    ap.add_argument("--llama-threads", default=None)
    ap.add_argument("--draw", nargs=2, help=argparse.SUPPRESS)  # internal: N DIR, draw the family
    args = ap.parse_args()
    if args.draw:
        sl.EXPERTS = NAMES[: int(args.draw[0])]
        sl._family(Path(args.draw[1]), sl.RUNGS["360m"])
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="moetool-sparse-"))
    for n in (int(x) for x in args.experts.split(",")):
        root = work / f"360m-{n}e"
        moe = family(n, root)
        print(f"\n## {n} experts, top-2 ({moe})", flush=True)
        cmd = [sys.executable, str(Path(__file__).parent / "export_latency.py"), "--model", str(moe), "--quant",
               "moe-q4", "--targets", args.targets, "--onnx-moe", "sparse,dense", "--artifacts", str(root / "art")]  # fmt: skip
        if args.llama_threads:
            cmd += ["--llama-threads", args.llama_threads]
        (root / "art").mkdir(exist_ok=True)
        subprocess.run(cmd, check=True)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
