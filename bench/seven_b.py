"""The 7B rung: four experts in Mistral-7B's shape merged, evaluated and exported to a verified GGUF on this machine.

The base is random bf16 weights in Mistral-7B's shape (hidden 4096, MLP 14336, 32 layers, 32 query and 8 key/value
heads, untied head) with SmolLM2's vocabulary (49,152): 7.25B parameters, 14.5 GB, drawn tensor by tensor into
5 GB shards. The four experts are hard links to the base's files: a disk of about 70 GB holds the base, the
24B-parameter MoE (48.7 GB) and its 4-bit GGUF, not four distinct 14.5 GB experts beside them. Identical experts
make the MoE's output equal the dense base's whatever the routers choose, so the MoE's perplexity must equal the
base's: the rung checks the merge and the streamed evaluation at 24B parameters. Each stage is its own process;
the table gives its wall time, peak RSS (``wait4``) and the peak of its anonymous memory (sampled from
``/proc/PID/status`` every 0.2 s): a mapped file's pages (llama.cpp maps the GGUF) count in RSS but are the page
cache's, given back under pressure.

    base eval (perplexity on 4,096 tokens) → merge (top-2 of 4) → [inputs deleted] → MoE eval → GGUF q4_k with
    verification → [GGUF deleted] → llama.cpp's convert_hf_to_gguf.py --outtype q8_0

llama.cpp's own route is convert_hf_to_gguf.py to a 16- or 8-bit GGUF, then llama-quantize: its intermediate
(25.9 GB at q8_0) does not fit beside the MoE on this disk, so the converter's file has its written part punched
out as it grows (its header is read back at the end), and llama-quantize, which needs that file, is not run.

    .venv/bin/python bench/seven_b.py [--work DIR] [--only STAGES] [--keep] [--layers N] [--budget SIZE]

``--layers N`` runs a slice of the rung: the same layers (and embeddings, and head) in Mistral-7B's shape, N of them.
A stage that streams its layers from disk holds the weights outside the layer stack and one layer at a time, so its
peak is the whole rung's in a fraction of the time and disk. ``--budget`` sets ``MOETOOL_MEMORY_BUDGET`` for every
stage: the memory each may plan for (with a slice, what makes evaluation and verification stream as the whole rung
must on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import size_ladder as sl

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8}  # fmt: skip
SHARD = 5 * 10**9
# beside the converter: its output's written part is punched out of the file as it grows (the file keeps its size
# and offsets, which the writer's tell() needs, and a pipe has not; the disk keeps only the last few hundred MB);
# at the end the GGUF's header is read back and the bytes written counted
_PUNCHER = """
import ctypes, os, struct, sys, time
path, done = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
while not os.path.exists(path):
    time.sleep(0.2)
fd = os.open(path, os.O_RDWR)
KEEP, LAG, punched = 64 << 20, 512 << 20, 64 << 20
while True:
    finished = os.path.exists(done)
    size = os.fstat(fd).st_size
    end = (size - (0 if finished else LAG)) // 4096 * 4096
    if end > punched:
        if libc.fallocate(fd, 3, punched, end - punched):  # PUNCH_HOLE | KEEP_SIZE
            raise OSError(ctypes.get_errno(), "fallocate")
        punched = end
    if finished:
        break
    time.sleep(1)
magic, version, tensors, kv = struct.unpack("<4sIQQ", os.pread(fd, 24, 0))
assert magic == b"GGUF", magic
print(f"GGUF v{version}: {tensors} tensors, {kv} keys, {size} bytes written and punched out")
"""


def draw(root: Path, layers: int = 32) -> dict[str, Path]:
    """Base (``layers`` decoder layers) as bf16 shards written one tensor at a time; experts as hard links to its
    files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from moetool.io.writer import ShardedWriter

    cfg = LlamaConfig(vocab_size=sl.VOCAB, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, rope_theta=1000000.0, **SHAPE | {"num_hidden_layers": layers})  # fmt: skip
    with torch.device("meta"):
        names = sorted((n, tuple(p.shape)) for n, p in LlamaForCausalLM(cfg).state_dict().items())
    base = root / "base"
    base.mkdir(parents=True, exist_ok=True)
    with ShardedWriter(base, [(n, torch.bfloat16, s) for n, s in names], SHARD) as w:
        for i, (n, shp) in enumerate(names):
            if len(shp) == 1:
                w.add(n, torch.ones(shp, dtype=torch.bfloat16))
                continue
            g = torch.Generator().manual_seed(i * 97)
            w.add(n, (torch.randn(shp, generator=g) * 0.02).to(torch.bfloat16))
    d = cfg.to_dict() | {"dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}
    (base / "config.json").write_text(json.dumps(d, indent=2))
    sl._tokenizer(base)
    paths = {"base": base}
    for name in sl.EXPERTS:
        out = root / name
        out.mkdir(exist_ok=True)
        for f in base.iterdir():
            if not (out / f.name).exists():
                os.link(f, out / f.name)
        paths[name] = out
    return paths


def _converter(moe: Path, root: Path) -> list[str]:
    out, done = root / "llama-cpp.q8_0.gguf", root / "convert.done"
    out.unlink(missing_ok=True)
    done.unlink(missing_ok=True)
    punch = f"{sys.executable} -c '{_PUNCHER}' {out} {done} > {root / 'convert-punch.log'} &"
    conv = f"{sys.executable} {ROOT / 'scripts' / 'llama_converter.py'} {moe} --outfile {out} --outtype q8_0"
    return ["bash", "-c", f"{punch} {conv}; rc=$?; touch {done}; wait; rm -f {out} {done}; exit $rc"]


def _llama_route(moe: Path, root: Path, tools: Path, quant: str) -> list[tuple[str, list[str], None]]:
    """llama.cpp's own two steps, kept file and all: ``convert_hf_to_gguf.py --outtype bf16``, then ``llama-quantize``
    to ``quant``, the bf16 file deleted after. They run where the disk holds the bf16 file beside the MoE (a slice of
    the rung; the whole rung's 48.6 GB file does not fit beside its MoE here)."""
    bf16, out = root / "llama-cpp.bf16.gguf", root / f"llama-cpp.{quant}.gguf"
    moe_bytes = sum(f.stat().st_size for f in moe.glob("*.safetensors"))
    free = shutil.disk_usage(root).free
    if moe_bytes + (1 << 30) > free:
        why = f"the bf16 GGUF needs {moe_bytes / 1e9:.1f} GB beside the MoE, {free / 1e9:.1f} GB free"
        return [("llama.cpp convert bf16 + llama-quantize", ["bash", "-c", f"echo 'not run: {why}'; exit 1"], None)]
    conv = [sys.executable, str(ROOT / "scripts" / "llama_converter.py"), str(moe), "--outfile", str(bf16),
            "--outtype", "bf16"]  # fmt: skip
    quantize = ["bash", "-c", f"{tools / 'llama-quantize'} {bf16} {out} {quant.upper()}; rc=$?; rm -f {bf16} {out}; "
                "exit $rc"]  # fmt: skip
    return [("llama.cpp convert bf16", conv, None), (f"llama-quantize {quant}", quantize, None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument(
        "--only", default=None, help="comma-separated stages (default: all; 'llama.cpp route': convert + quantize)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the rung's files")
    ap.add_argument("--quant", default="q4_k")
    ap.add_argument("--llama-tools", type=Path, default=ROOT / "out" / "llama-tools" / "bin",
                    help="llama-quantize's folder (scripts/build_llama_tools.sh)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="decoder layers (a slice)")
    ap.add_argument("--budget", default=None, help="MOETOOL_MEMORY_BUDGET for every stage, e.g. 8G")
    ap.add_argument("--draw", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.draw:  # internal: the family, drawn in a process of its own
        draw(a.draw, a.layers)
        return
    if a.budget:
        os.environ["MOETOOL_MEMORY_BUDGET"] = a.budget  # the stages' processes inherit it
    work = a.work or Path(tempfile.mkdtemp(prefix="moetool-7b-"))
    models = work / "models"
    only = a.only.split(",") if a.only else None
    if not (models / "math" / "config.json").is_file() and (not only or {"base eval", "merge"} & set(only)):
        subprocess.run([sys.executable, __file__, "--draw", str(models), "--layers", str(a.layers)], check=True)
    paths = {n: models / n for n in ("base", *sl.EXPERTS)}
    texts = sl._texts(work)
    recipe = sl._recipe(work, paths, texts)
    moe, gguf = work / "moe", work / "gguf"
    moetool = str(BIN / "moetool")
    evaluate = ["eval", "--data", f"code={texts['code']}", "--max-tokens", "4096"]
    stages = [
        ("base eval", [moetool, evaluate[0], str(paths["base"]), *evaluate[1:]], None),
        ("merge", [moetool, "merge", str(recipe), "-o", str(moe), "--force"], models),
        ("eval", [moetool, evaluate[0], str(moe), *evaluate[1:]], None),
        (f"gguf {a.quant}", [moetool, "export", str(moe), "-o", str(gguf), "--quant", a.quant, "--force"], None),
        ("llama.cpp convert q8_0", _converter(moe, work), None),
    ]
    if not only or any(x.startswith("llama") for x in only):  # the MoE exists once merged: look at the disk then
        stages.append(("llama.cpp route", [], None))
    rows = []
    for stage, args, drop_after in stages:
        if stage == "llama.cpp route":
            route = _llama_route(moe, work, a.llama_tools, "q4_0" if a.quant == "moe-q4" else a.quant)
            if only and "llama.cpp route" in only:
                only += [x[0] for x in route]
            stages.extend(route)
            continue
        if only and stage not in only:
            continue
        wall, rss, anon, code, last = sl.measured(args, work / f"{stage.replace(' ', '-')}.log")
        rows.append((stage, wall, rss, anon, code, last))
        print(f"  {stage}: {wall:.0f} s, peak {rss / 1e9:.2f} GB (anonymous {anon / 1e9:.2f} GB), exit {code}: "
              f"{last[:160]}", flush=True)  # fmt: skip
        if drop_after is not None and code == 0:  # the inputs once merged: the disk holds the MoE and its GGUF
            shutil.rmtree(drop_after, ignore_errors=True)
    moe_bytes = sum(f.stat().st_size for f in moe.glob("*.safetensors"))
    print(f"\n| stage | wall | peak RSS | peak anonymous | × MoE ({moe_bytes / 1e9:.1f} GB) | result |")
    print("|---|---|---|---|---|---|")
    for stage, wall, rss, anon, code, last in rows:
        result = "ok" if code == 0 else f"exit {code}: {last[:90]}"
        print(f"| {stage} | {wall:.0f} s | {rss / 1e9:.2f} GB | {anon / 1e9:.2f} GB | {rss / max(moe_bytes, 1):.2f}× | "
              f"{result} |")  # fmt: skip
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
