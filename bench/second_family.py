"""A second model family for the importance-matrix quantization benchmark: a small Qwen3 zoo merged into a Qwen3-MoE.

    .venv/bin/python bench/second_family.py [--out out/qwen3-family] [--base-steps 320] [--expert-steps 150]
                                            [--reuse] [--force] [--no-export]

What it builds under ``--out`` (the benchmark's SmolLM2 models are Llama; this family is Qwen3, so its GGUF is
``qwen3moe`` with per-head q/k norms and no Mixtral layout):

1. ``base``: a dense ``Qwen3ForCausalLM`` from scratch (hidden 256, MLP 768, 4 layers, 4 query / 2 KV heads of 64,
   tied embeddings, rope θ 1e6) on the real SmolLM2 tokenizer (vocab 49152, copied from the ``smollm2`` zoo's base),
   trained briefly on the zoo's code, legal and medical training text, sampled equally. Row lengths 256 and 768 are
   multiples of 256, as llama.cpp's K and IQ quant types need.
2. ``code``, ``legal``, ``medical``: one expert per domain, the base with only its MLP weights trained further on
   that domain's text (attention, norms and embeddings stay the base's, as a MoFE merge assumes).
3. ``recipe.yaml`` → ``moe`` (``moetool merge``: a ``qwen3_moe`` with hidden-state routers from a few prompts per
   domain) → ``moe-tuned`` (``moetool train``: 30 steps of router tuning on the zoo's domains). ``moe-tuned`` keeps
   the recipe as ``moetool-recipe.yaml``, so ``moetool export --imatrix auto`` calibrates on the same domains.
4. ``gguf-q8``: ``moetool export moe-tuned --quant q8_0``, whose conversion check runs the GGUF in llama.cpp.

Held-out perplexity (``--windows`` windows of 128 tokens per domain, the zoo's valid split) of the base, each expert
and both MoEs is printed as a table and kept with each phase's wall time in ``summary.json``. Training runs on one
thread with bfloat16 autocast (float32 weights), so the whole script takes about a quarter of an hour on a shared
CPU. ``--reuse`` loads base and experts already in ``--out`` instead of training them again; ``--force`` replaces
the MoE folders and the export.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from moetool.paths import zoo_dir
from moetool.zoo import DOMAINS, quiet_transformers, zoo_domain_text

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SEQ_LEN = 128
BATCH = 8

# short texts typical of each zoo domain, for the merged MoE's hidden-state routers
PROMPTS: dict[str, list[str]] = {
    "code": [
        "def main():\n    for i in range(10):\n        print(i)",
        "import os\nimport sys\n\nclass Parser(object):",
        "if __name__ == '__main__':\n    main()",
        "return self.value",
    ],
    "legal": [
        "Permission is hereby granted, free of charge, to any person obtaining a copy",
        "THE SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND",
        "This program is free software; you can redistribute it and/or modify it under the terms of the GNU",
        "Licensed under the Apache License, Version 2.0",
    ],
    "medical": [
        "Acute bronchitis due to respiratory syncytial virus",
        "Type 2 diabetes mellitus with diabetic chronic kidney disease",
        "Fracture of shaft of left femur, initial encounter",
        "Malignant neoplasm of upper lobe, right bronchus or lung",
    ],
}


def log(msg: str) -> None:
    print(msg, flush=True)


def load_tokenizer(src: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(src))


def qwen3_config(tok: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    )


def encode(tok: Any, text: str) -> torch.Tensor:
    with quiet_transformers():  # a whole split is longer than model_max_length: no warning for that
        ids = tok(text, add_special_tokens=False).input_ids
    return torch.tensor(ids, dtype=torch.long)


def batches(streams: dict[str, torch.Tensor], bos: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches of ``[bos, 127 tokens]`` rows at random offsets, each row's domain drawn equally."""
    g = torch.Generator().manual_seed(seed)
    names = list(streams)
    while True:
        rows = []
        for _ in range(BATCH):
            ids = streams[names[int(torch.randint(len(names), (1,), generator=g))]]
            start = int(torch.randint(len(ids) - SEQ_LEN, (1,), generator=g))
            rows.append(torch.cat([torch.tensor([bos]), ids[start : start + SEQ_LEN - 1]]))
        yield torch.stack(rows)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_loop(
    model: Any, streams: dict[str, torch.Tensor], bos: int, *, steps: int, lr: float, warmup: int, seed: int, label: str
) -> list[float]:
    """AdamW on the parameters that require grad; bfloat16 autocast (twice as fast on this CPU), float32 weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    for step, x in zip(range(steps), batches(streams, bos, seed), strict=False):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if (step + 1) % 25 == 0 or step + 1 == steps:
            recent = sum(losses[-25:]) / len(losses[-25:])
            rate = (time.perf_counter() - t0) / (step + 1)
            log(f"  {label} step {step + 1}/{steps} loss {recent:.3f} ({rate:.2f} s/step)")
    model.eval()
    return losses


def valid_windows(tok: Any, n: int) -> dict[str, torch.Tensor]:
    """``n`` consecutive ``[bos, 127 tokens]`` windows of each domain's held-out text."""
    out = {}
    for d in DOMAINS:
        ids = encode(tok, zoo_domain_text(d, "valid"))
        step = SEQ_LEN - 1
        if len(ids) < n * step:
            raise SystemExit(f"{d}: held-out text has {len(ids)} tokens, fewer than {n} windows of {step}")
        out[d] = torch.stack(
            [torch.cat([torch.tensor([tok.bos_token_id]), ids[i * step : (i + 1) * step]]) for i in range(n)]
        )
    return out


@torch.inference_mode()
def perplexity(model: Any, windows: dict[str, torch.Tensor]) -> dict[str, float]:
    """Float32 perplexity per domain over the windows (every token after the first)."""
    model.eval()
    out = {}
    for d, w in windows.items():
        total, count = 0.0, 0
        for chunk in w.split(BATCH):
            logits = model(input_ids=chunk).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
            total += float(nll) * chunk[:, 1:].numel()
            count += chunk[:, 1:].numel()
        out[d] = math.exp(total / count)
    return out


def save(model: Any, path: Path, tok_src: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(str(path), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tok_src / name).is_file():
            shutil.copy2(tok_src / name, path / name)


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def recipe(out: Path) -> dict[str, Any]:
    root = out.resolve()  # absolute: the recipe is kept verbatim inside the MoE folders, away from out/
    return {
        "name": "qwen3-family-mofe",
        "method": "mofe",
        "base_model": str(root / "base"),
        "architecture": "qwen3_moe",
        "experts_per_token": 2,
        "gate_mode": "hidden",
        "dtype": "float32",
        "experts": [{"name": d, "source": str(root / d), "positive_prompts": PROMPTS[d]} for d in DOMAINS],
        "freeze": {"preset": "mofe"},
        "train": {
            "data": {d: {"zoo": f"smollm2-{d}"} for d in DOMAINS},
            "steps": 30,
            "learning_rate": 0.0002,
            "router_learning_rate": 0.05,
            "schedule": "cosine",
            "warmup_steps": 3,
            "batch_size": 4,
            "seq_len": SEQ_LEN,
            "checkpoint_every": 30,
            "log_every": 5,
        },
    }


def table(ppl: dict[str, dict[str, float]]) -> str:
    lines = [f"{'model':<12}" + "".join(f"{d:>10}" for d in DOMAINS)]
    lines += [f"{m:<12}" + "".join(f"{row[d]:>10.2f}" for d in DOMAINS) for m, row in ppl.items()]
    return "\n".join(lines)


def build_dense(
    args: argparse.Namespace, tok: Any, tok_src: Path, windows: dict[str, torch.Tensor], timing: dict[str, float]
) -> dict[str, dict[str, float]]:
    """Base and experts: trained (or, with ``--reuse``, loaded) and saved; their perplexity per domain."""
    from transformers import Qwen3ForCausalLM

    out: Path = args.out
    names = ["base", *DOMAINS]
    ppl: dict[str, dict[str, float]] = {}
    if args.reuse and all((out / n / "config.json").is_file() for n in names):
        log("reusing base and experts in " + str(out))
        for n in names:
            ppl[n] = perplexity(load(out / n), windows)
        return ppl

    t = time.perf_counter()
    streams = {d: encode(tok, zoo_domain_text(d, "train")) for d in DOMAINS}
    timing["tokenize"] = time.perf_counter() - t
    log("train tokens: " + ", ".join(f"{d} {len(s)}" for d, s in streams.items()))

    t = time.perf_counter()
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(qwen3_config(tok))
    log(f"base: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters")
    train_loop(base, streams, tok.bos_token_id, steps=args.base_steps, lr=3e-3, warmup=30, seed=0, label="base")
    save(base, out / "base", tok_src)
    timing["train_base"] = time.perf_counter() - t
    ppl["base"] = perplexity(base, windows)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}

    t = time.perf_counter()
    for i, d in enumerate(DOMAINS):
        base.load_state_dict(base_state)
        for name, p in base.named_parameters():
            p.requires_grad_(".mlp." in name)
        train_loop(
            base, {d: streams[d]}, tok.bos_token_id, steps=args.expert_steps, lr=1e-3, warmup=10, seed=1 + i, label=d
        )
        save(base, out / d, tok_src)
        ppl[d] = perplexity(base, windows)
    timing["train_experts"] = time.perf_counter() - t
    return ppl


def export_q8(tuned: Path, dest: Path, force: bool) -> dict[str, Any]:
    """``moetool export TUNED -o DEST --quant q8_0`` (its conversion check runs the GGUF in llama.cpp)."""
    cli = Path(sys.executable).with_name("moetool")
    cmd = [str(cli), "export", str(tuned), "-o", str(dest), "--quant", "q8_0", *(["--force"] if force else [])]
    log("$ " + " ".join(cmd))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env)
    manifest: dict[str, Any] = json.loads((dest / "manifest.json").read_text())
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out/qwen3-family"))
    ap.add_argument("--base-steps", type=int, default=320)
    ap.add_argument("--expert-steps", type=int, default=150)
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 128 tokens per domain")
    ap.add_argument("--reuse", action="store_true", help="load base and experts already in --out")
    ap.add_argument("--force", action="store_true", help="replace the MoE folders and the export")
    ap.add_argument("--no-export", action="store_true", help="stop after the tuned MoE")
    args = ap.parse_args()

    torch.set_num_threads(1)
    from rich.console import Console

    from moetool.api import assemble, train

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    timing: dict[str, float] = {}
    t_all = time.perf_counter()
    tok_src = zoo_dir("smollm2") / "base"
    tok = load_tokenizer(tok_src)
    windows = valid_windows(tok, args.windows)

    ppl = build_dense(args, tok, tok_src, windows, timing)
    log("\nheld-out perplexity, dense models\n" + table(ppl))
    for d in DOMAINS:
        if ppl[d][d] >= ppl["base"][d]:
            log(f"warning: the {d} expert does not beat the base on {d}")
    gc.collect()

    recipe_path = out / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(out), sort_keys=False, width=120))
    console = Console()
    t = time.perf_counter()
    merged = assemble(recipe_path, out / "moe", force=args.force, console=console)
    timing["merge"] = time.perf_counter() - t
    ppl["moe"] = perplexity(load(merged), windows)

    t = time.perf_counter()
    outcome = train(recipe_path, out / "moe-tuned", model=merged, force=args.force, console=console)
    timing["tune"] = time.perf_counter() - t
    for label, value in outcome.figures.items():
        log(f"  {label}: {value}")
    tuned = outcome.output
    if not (tuned / "moetool-recipe.yaml").is_file():
        raise SystemExit(f"{tuned} has no moetool-recipe.yaml: `moetool export --imatrix auto` would find no data")
    ppl["moe-tuned"] = perplexity(load(tuned), windows)
    log("\nheld-out perplexity\n" + table(ppl))

    summary: dict[str, Any] = {"perplexity": ppl, "windows": args.windows, "seq_len": SEQ_LEN, "tuned": str(tuned)}
    if not args.no_export:
        t = time.perf_counter()
        manifest = export_q8(tuned, out / "gguf-q8", args.force)
        timing["export_q8"] = time.perf_counter() - t
        summary["q8_0"] = {"file": manifest.get("file"), "parity": manifest.get("parity")}
        parity = manifest.get("parity") or {}
        log(
            f"q8_0: top-1 {parity.get('top1_agreement')}, perplexity {parity.get('ppl_reference')} -> "
            f"{parity.get('ppl_artifact')} ({parity.get('ppl_change')})"
        )
    timing["total"] = time.perf_counter() - t_all
    summary["seconds"] = {k: round(v, 1) for k, v in timing.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log("\nwall time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timing.items()))
    log(f"tuned MoE: {tuned}")


if __name__ == "__main__":
    main()
