"""The size ladder: families of random bf16 weights in real shapes, through every stage, with wall time and peak RSS.

Each rung is a base and four experts (the base with its MLPs re-drawn) in the shape of SmolLM2-135M, -360M or -1.7B,
stored in bf16, with SmolLM2's tokenizer when the real zoo is built (else a byte-level BPE of the same vocabulary
size trained on Python's documentation). Each stage runs as its own ``moetool`` process, so its peak RSS is its own
(``wait4``):

    merge (top-2 of 4, cheap_embed routers, bf16) → train (a few steps, the model's own dtype) → eval (perplexity on
    4,096 tokens) → GGUF q8_0 export with verification → ONNX q8_0 export → ONNX, Core ML, ExecuTorch and TFLite
    moe-q4 exports (4-bit experts)

or, with ``--experts``, the merge followed by ``moetool experts`` remove (without and with its parity check), prune,
add and extract,

and the table gives each stage's wall time, peak RSS and that peak as a multiple of the MoE's bf16 bytes. A stage
that refuses up front (its budget check) is reported as refused, with the first line of its reason.

    .venv/bin/python bench/size_ladder.py --rungs 135m,360m [--work DIR] [--keep] [--experts] [--only STAGES]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

BIN = Path(sys.executable).parent
RUNGS = {
    # a smoke test of the script itself (seconds), not a rung of the ladder
    "smoke": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2},
    "135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3},
    "360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
             "num_key_value_heads": 5},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
             "num_key_value_heads": 32},
    # Llama-3.2-3B's shape with SmolLM2's vocabulary: 2.97B parameters, 5.9 GB in bf16 (bench/larger_than_ram.py)
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8},
}  # fmt: skip
VOCAB = 49152
EXPERTS = ("code", "legal", "medical", "math")


def _tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer from the real zoo when it is built, else a byte-level BPE trained here."""
    zoo = Path(os.environ.get("MOETOOL_CACHE", Path.home() / ".cache" / "moetool")) / "zoo" / "smollm2" / "base"
    if (zoo / "tokenizer.json").is_file():
        for f in zoo.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy2(f, out / f.name)
        return
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # every byte a token, as in any released byte-level vocabulary: a byte the vocabulary lacks is dropped, and
    # transformers then merges its neighbours where llama.cpp does not (the GGUF's tokenizer check refuses it)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(topics.values()), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")
    fast.save_pretrained(str(out))


def _family(root: Path, shape: dict[str, int]) -> dict[str, Path]:
    """Base and experts as bf16 safetensors, written one model at a time (each tensor drawn from its own seed)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, rope_theta=100000.0, **shape)  # fmt: skip
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in LlamaForCausalLM(cfg).state_dict().items()}
    paths = {}
    for k, name in enumerate(("base", *EXPERTS)):
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, (n, shp) in enumerate(sorted(names.items())):
            if n == "lm_head.weight":
                continue
            seed = i * 97 + (k if ".mlp." in n else 0)
            g = torch.Generator().manual_seed(seed)
            if len(shp) == 1:
                tensors[n] = torch.ones(shp, dtype=torch.bfloat16)
            else:
                tensors[n] = (torch.randn(shp, generator=g) * 0.02).to(torch.bfloat16)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        d = cfg.to_dict() | {"dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}
        (out / "config.json").write_text(json.dumps(d, indent=2))
        _tokenizer(out)
        paths[name] = out
    return paths


def _texts(root: Path) -> dict[str, Path]:
    from pydoc_data.topics import topics

    body = "\n\n".join(topics.values())
    out = {}
    for i, d in enumerate(EXPERTS):
        p = root / f"{d}.txt"
        p.write_text(body[i * 60_000 : (i + 1) * 60_000] + "\n\n" + body[-40_000:], encoding="utf-8")
        out[d] = p
    return out


def _recipe(root: Path, paths: dict[str, Path], texts: dict[str, Path]) -> Path:
    experts = "\n".join(
        f"  - {{name: {d}, source: {paths[d]}, positive_prompts: [{json.dumps(texts[d].read_text()[:80])}]}}"
        for d in EXPERTS
    )
    data = "\n".join(f"    {d}: {{text: {texts[d]}}}" for d in EXPERTS)
    text = (
        f"name: ladder\nmethod: mofe\nbase_model: {paths['base']}\nexperts_per_token: 2\ngate_mode: cheap_embed\n"
        f"dtype: bfloat16\nexperts:\n{experts}\nfreeze:\n  preset: mofe\ntrain:\n  data:\n{data}\n  steps: 3\n"
        "  batch_size: 2\n  seq_len: 128\n  warmup_steps: 0\n  checkpoint_every: 1000\n"
    )
    path = root / "recipe.yaml"
    path.write_text(text)
    return path


def drawn_rung(root: Path, rung: str) -> Path:
    """The ladder recipe of ``rung`` under ``root`` (``recipe.yaml``), its family drawn into ``root/models`` first
    unless it is there already, in a child process (the drawing's memory is not the caller's)."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "models" / "base" / "config.json").is_file():
        subprocess.run([sys.executable, str(Path(__file__)), "--family", rung, str(root / "models")], check=True)
    paths = {n: root / "models" / n for n in ("base", *EXPERTS)}
    return _recipe(root, paths, _texts(root))


def tree_memory(pid: int) -> tuple[int, int]:
    """(resident, anonymous resident) bytes of ``pid`` and every process below it, summed (a stage may run its
    tools, or each chunk of an export, as children)."""
    rss = anon = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) * 1024
            elif line.startswith("RssAnon:"):
                anon += int(line.split()[1]) * 1024
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                r, a = tree_memory(int(child))
                rss, anon = rss + r, anon + a
    except OSError:  # the process ended between two reads
        pass
    return rss, anon


def measured(args: list[str], log: Path) -> tuple[float, int, int, int, str]:
    """(wall seconds, peak RSS bytes, peak anonymous bytes, exit code, last line of output) of one process and its
    children. The peak RSS is the larger of ``wait4``'s (the largest single process) and the process tree's sum
    sampled every 0.2 s (a parent and the child it waits on are resident together). RSS also counts a mapped file's
    pages, which are the page cache's; the anonymous figure is the processes' own memory."""
    t0 = time.perf_counter()
    peak_rss = peak_anon = 0
    with open(log, "w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak_rss, peak_anon
            while not done.wait(0.2):
                rss, anon = tree_memory(proc.pid)
                peak_rss, peak_anon = max(peak_rss, rss), max(peak_anon, anon)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        done.set()
        sampler.join()
    wall = time.perf_counter() - t0
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    rss = max(usage.ru_maxrss * 1024, peak_rss)
    return wall, rss, peak_anon, os.waitstatus_to_exitcode(status), lines[-1] if lines else ""


def _run(args: list[str], log: Path) -> tuple[float, int, int, str]:
    """(wall seconds, peak RSS bytes, exit code, last line of output) of one process."""
    wall, rss, _, code, last = measured(args, log)
    return wall, rss, code, last


def _edit_stages(root: Path, moe: Path, paths: dict[str, Path], texts: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """``moetool experts`` on the merged MoE: remove (streaming alone, then with its parity check), prune by frequency
    on calibration text, add the removed expert back (router row from a prompt), extract one as a dense model."""
    moetool = str(BIN / "moetool")
    prompt = texts["math"].read_text()[:80]
    return [
        ("experts remove --no-verify", [moetool, "experts", "remove", str(moe), "math", "-o", str(root / "rm-nc"),
                                       "--no-verify", "--force"]),
        ("experts remove", [moetool, "experts", "remove", str(moe), "math", "-o", str(root / "rm"), "--force"]),
        ("experts prune", [moetool, "experts", "prune", str(moe), "--keep", "2", "--by", "frequency", "--data",
                           f"code={texts['code']}", "--max-tokens", "1024", "-o", str(root / "pruned"), "--force"]),
        ("experts add", [moetool, "experts", "add", str(root / "rm"), "--source", str(paths["math"]), "--name", "math",
                         "--prompt", prompt, "-o", str(root / "added"), "--force"]),
        ("experts extract", [moetool, "experts", "extract", str(moe), "legal", "-o", str(root / "dense"), "--force"]),
    ]  # fmt: skip


def rung(
    name: str, work: Path, experts: bool = False, only: list[str] | None = None
) -> list[tuple[str, float, int, int, str]]:
    root = work / name
    root.mkdir(parents=True, exist_ok=True)
    # the family is drawn in a process of its own: a child forked from a parent that holds gigabytes of weights
    # reports the parent's resident pages in its own peak RSS (Linux counts them until exec)
    subprocess.run([sys.executable, __file__, "--family", name, str(root / "models")], check=True)
    paths = {n: root / "models" / n for n in ("base", *EXPERTS)}
    texts = _texts(root)
    recipe = _recipe(root, paths, texts)
    moe = root / "moe"
    tuned = root / "tuned" if not only or "train" in only else moe  # eval and export read the merge when not tuned
    moetool = str(BIN / "moetool")
    stages = [
        ("merge", [moetool, "merge", str(recipe), "-o", str(moe), "--force"]),
        ("train", [moetool, "train", str(recipe), "--model", str(moe), "-o", str(tuned), "--force", "--no-resume"]),
        ("eval", [moetool, "eval", str(tuned), "--data", f"code={texts['code']}", "--max-tokens", "4096"]),
        ("gguf q8_0", [moetool, "export", str(tuned), "-o", str(root / "gguf"), "--quant", "q8_0", "--force"]),
        ("onnx q8_0", [moetool, "export", str(tuned), "-o", str(root / "onnx"), "--target", "onnx", "--quant",
                       "q8_0", "--force"]),
        # what a phone runs: 4-bit experts (QMoE), router f32, the rest 8-bit
        ("onnx moe-q4", [moetool, "export", str(tuned), "-o", str(root / "onnx-q4"), "--target", "onnx", "--quant",
                         "moe-q4", "--force"]),
        # Core ML, ExecuTorch and TFLite convert a chunk of layers at a time (by default 256 MiB of float32 layers
        # each; ExecuTorch and TFLite in a process per chunk)
        ("coreml moe-q4", [moetool, "export", str(tuned), "-o", str(root / "coreml-q4"), "--target", "coreml",
                           "--quant", "moe-q4", "--force"]),
        ("executorch moe-q4", [moetool, "export", str(tuned), "-o", str(root / "executorch-q4"), "--target",
                               "executorch", "--quant", "moe-q4", "--force"]),
        ("tflite moe-q4", [moetool, "export", str(tuned), "-o", str(root / "tflite-q4"), "--target", "tflite",
                           "--quant", "moe-q4", "--force"]),
    ]  # fmt: skip
    if experts:  # the merge, then every edit of `moetool experts` on it
        stages = stages[:1] + _edit_stages(root, moe, paths, texts)
    if only:  # the merge, then the named stages (a rung whose outputs together do not fit on the disk)
        stages = stages[:1] + [s for s in stages[1:] if s[0] in only]
    rows = []
    for stage, args in stages:
        wall, rss, code, last = _run(args, root / f"{stage.replace(' ', '-')}.log")
        rows.append((stage, wall, rss, code, last))
        print(f"  {name} {stage}: {wall:.1f} s, peak {rss / 1e9:.2f} GB, exit {code}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rungs", default="135m,360m")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the models and outputs")
    ap.add_argument(
        "--experts", action="store_true", help="the merge, then `moetool experts` edits instead of the rest"
    )
    ap.add_argument("--only", default=None, help="comma-separated stages to run after the merge (default: all)")
    ap.add_argument("--family", nargs=2, metavar=("RUNG", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.family:  # internal: draw one rung's family into DIR (see rung())
        _family(Path(args.family[1]), RUNGS[args.family[0]])
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="moetool-ladder-"))
    table = []
    for name in args.rungs.split(","):
        rows = rung(name, work, args.experts, args.only.split(",") if args.only else None)
        moe_bytes = sum(f.stat().st_size for f in (work / name / "moe").glob("*.safetensors"))
        table += [(name, moe_bytes, *r) for r in rows]
        if not args.keep:
            shutil.rmtree(work / name, ignore_errors=True)
    print("\n| rung | MoE (bf16) | stage | wall | peak RSS | × MoE | result |\n|---|---|---|---|---|---|---|")
    for name, moe_bytes, stage, wall, rss, code, last in table:
        result = "ok" if code == 0 else f"exit {code}: {last[:90]}"
        print(
            f"| {name} | {moe_bytes / 1e9:.2f} GB | {stage} | {wall:.0f} s | {rss / 1e9:.2f} GB | "
            f"{rss / max(moe_bytes, 1):.1f}× | {result} |"
        )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
