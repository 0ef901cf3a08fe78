"""The GPU path on the 1.7B rung: merge, bf16 router tuning and evaluation on CUDA, and a training step's tokens/s
against the dense model with the same active parameters.

The family is the size ladder's 1.7B rung (``bench/size_ladder.py``: a SmolLM2-1.7B-shaped base and four experts,
random bf16 weights, SmolLM2's tokenizer when the zoo is built). Each ``moetool`` stage runs as its own process with
``--device cuda`` (merge: the hidden-state router initialisation; train: the model's own dtype, bf16 with float32
trainable weights under autocast; eval: perplexity on 4,096 tokens), and the table gives its wall time and the
tokens/s the training printed. Then, in this process, one training step as ``moetool train`` takes it (the mofe
freeze, float32 trainable weights, bf16 autocast, AdamW) is timed on the merged MoE for each of transformers' expert
kernels and on a dense Llama whose MLP is ``top_k × intermediate`` wide: the same parameters active per token.

    python bench/gpu_check.py [--work DIR] [--steps 20] [--batch 8] [--seq 512]

Needs a CUDA device; the project itself never does (tests run on CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("size_ladder", HERE / "size_ladder.py")
assert _spec is not None and _spec.loader is not None
ladder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ladder)

MOETOOL = [sys.executable, "-c", "import sys; from moetool.cli import main; sys.argv[0] = 'moetool'; main()"]


def _stage(name: str, args: list[str], log: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run([*MOETOOL, *args], check=False, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    print(f"  {name}: {wall:.1f} s, exit {code}", flush=True)
    if code != 0:
        print(text[-3000:])
        raise SystemExit(f"{name} failed (exit {code}); log {log}")
    return wall, text


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peak() -> str:
    return f" (peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)" if torch.cuda.is_available() else ""


def step_tokens_per_s(model: torch.nn.Module, batch: torch.Tensor, steps: int) -> float:
    """Median tokens/s of a training step as `moetool train` runs it in bf16 (after one warm-up step)."""
    from moetool.train.precision import arithmetic_for, keep_trainable_float32

    keep_trainable_float32(model)
    arithmetic = arithmetic_for(model, torch.bfloat16, batch.device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    model.train()
    times = []
    for i in range(steps + 1):
        _sync(batch.device)
        t0 = time.perf_counter()
        with arithmetic.forward():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(batch.device)
        if i >= 1:
            times.append(time.perf_counter() - t0)
    return batch.numel() / statistics.median(times)


def compare_steps(moe_dir: Path, args: argparse.Namespace) -> list[tuple[int, str, float]]:
    """(batch, model, tokens/s) for the dense peer and the MoE under each expert kernel, every batch size."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from moetool.train.freeze import apply_freeze

    cfg = json.loads((moe_dir / "config.json").read_text())
    top_k = int(cfg["num_experts_per_tok"])
    ff = int(cfg["intermediate_size"])
    dev = torch.device(args.device)
    batches = {b: torch.randint(0, int(cfg["vocab_size"]), (b, args.seq), device=dev) for b in args.batches}
    rows: list[tuple[int, str, float]] = []
    shape = {k: cfg[k] for k in ladder.RUNGS[args.rung]} | {
        "vocab_size": cfg["vocab_size"],
        "tie_word_embeddings": True,
    }
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(**(shape | {"intermediate_size": top_k * ff}))).to(dev, torch.bfloat16)
    for n, p in dense.named_parameters():
        p.requires_grad_(".mlp." not in n)
    for b, batch in batches.items():
        rows.append((b, f"dense Llama, MLP {top_k}×{ff}", step_tokens_per_s(dense, batch, args.steps_timed)))
    del dense
    for impl in ("grouped_mm", "eager"):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        m: Any = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16, experts_implementation=impl)
        m.to(dev)
        apply_freeze(m, "mofe")
        for b, batch in batches.items():
            tps = step_tokens_per_s(m, batch, args.steps_timed)
            rows.append((b, f"MoE mofe step, {impl}{_peak()}", tps))
        del m
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/moetool-gpu-check"))
    ap.add_argument("--rung", default="1.7b", choices=sorted(ladder.RUNGS))
    ap.add_argument("--steps", type=int, default=20, help="moetool train steps")
    ap.add_argument("--steps-timed", type=int, default=6, help="timed steps of the in-process comparison")
    ap.add_argument("--batch", type=int, default=8, help="moetool train's batch")
    ap.add_argument(
        "--batches", type=lambda t: [int(x) for x in t.split(",")], default=[8], help="timed steps' batches"
    )
    ap.add_argument("--no-train", action="store_true", help="merge, then only the timed steps (no train, no eval)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="cpu runs the script's own smoke test (--rung smoke)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs one")
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    root = args.work
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, str(HERE / "size_ladder.py"), "--family", args.rung, str(root / "models")], check=True
    )
    print(f"  family drawn: {time.perf_counter() - t0:.1f} s", flush=True)
    paths = {n: root / "models" / n for n in ("base", *ladder.EXPERTS)}
    texts = ladder._texts(root)
    recipe = ladder._recipe(root, paths, texts)
    text = recipe.read_text().replace("gate_mode: cheap_embed", "gate_mode: hidden")
    text = re.sub(r"steps: \d+", f"steps: {args.steps}", text)
    text = text.replace("batch_size: 2", f"batch_size: {args.batch}").replace("seq_len: 128", f"seq_len: {args.seq}")
    recipe.write_text(text)
    moe, tuned = root / "moe", root / "tuned"
    walls = {}
    walls["merge (hidden-state routers)"], _ = _stage(
        "merge", ["merge", str(recipe), "-o", str(moe), "--force", "--device", args.device], root / "merge.log"
    )
    if not args.no_train:
        walls["train"], log = _stage(
            "train",
            [
                "train",
                str(recipe),
                "--model",
                str(moe),
                "-o",
                str(tuned),
                "--force",
                "--no-resume",
                "--device",
                args.device,
            ],
            root / "train.log",
        )
        walls["eval (4,096 tokens)"], eval_log = _stage(
            "eval",
            ["eval", str(tuned), "--data", f"code={texts['code']}", "--max-tokens", "4096", "--device", args.device],
            root / "eval.log",
        )
        rates = [float(x) for x in re.findall(r"(\d+) tok/s", log)]
        tuned_cfg = json.loads((tuned / "config.json").read_text())
        moe_bytes = sum(f.stat().st_size for f in moe.glob("*.safetensors"))
        tuned_bytes = sum(f.stat().st_size for f in tuned.glob("*.safetensors"))
        print(f"\nMoE {moe_bytes / 1e9:.2f} GB, tuned {tuned_bytes / 1e9:.2f} GB, tuned dtype {tuned_cfg.get('dtype')}")
        print("| stage | wall |\n|---|---|")
        for k, v in walls.items():
            print(f"| {k} | {v:.1f} s |")
        if rates:
            print(f"train tok/s as printed (last): {rates[-1]:.0f}")
        print("eval output (tail):\n" + "\n".join(eval_log.strip().splitlines()[-8:]))
    rows = compare_steps(moe, args)
    ref = {b: tps for b, name, tps in rows if name.startswith("dense")}
    print(f"\n| step (× {args.seq} tokens, bf16) | batch | tokens/s | × dense |\n|---|---|---|---|")
    for b, name, tps in rows:
        print(f"| {name} | {b} | {tps:,.0f} | {tps / ref[b]:.2f}× |")


if __name__ == "__main__":
    main()
