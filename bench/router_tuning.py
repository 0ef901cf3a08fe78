"""CPU router tuning speed: tokens/s of a `mofe` training step (forward, backward, AdamW) on a MoE against the same
step on the dense model with the same active parameters, for each of transformers' expert kernels.

The MoE is SmolLM2-135M-shaped (30 layers, hidden 576, intermediate 1536, 9 heads / 3 KV heads, vocab 49,152) with
``--experts`` experts, top-``--top-k``, random weights (speed does not depend on them), or ``--model DIR`` for a real
merged MoE. The dense peer has intermediate top_k × 1536: the same parameters active per token. Both train what
`mofe` trains (experts / the MLP frozen; attention, norms, embeddings, head and routers trainable).

Run:  .venv/bin/python bench/router_tuning.py [--steps 4] [--batch 4] [--seq 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig

from moetool.train.freeze import apply_freeze

SHAPE: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}


def step_tokens_per_s(model: torch.nn.Module, batch: torch.Tensor, steps: int) -> float:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    model.train()
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 1:  # the first step allocates and warms up
            times.append(time.perf_counter() - t0)
    return batch.numel() / statistics.median(times)


def moe(args: argparse.Namespace, impl: str) -> torch.nn.Module:
    if args.model:
        m = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, experts_implementation=impl)
    else:
        torch.manual_seed(0)
        cfg = MixtralConfig(**SHAPE, num_local_experts=args.experts, num_experts_per_tok=args.top_k)
        cfg._experts_implementation = impl
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    apply_freeze(m, "mofe")
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a merged MoE folder (default: SmolLM2-shaped, random weights)")
    ap.add_argument("--experts", type=int, default=3)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    # batched_mm gathers a copy of the chosen experts' weights per token ([tokens, I, H]): at this size it needs
    # tens of GB (killed for memory on a 24 GB machine), so it is left out by default
    ap.add_argument("--impls", default="eager,grouped_mm")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    top_k = args.top_k
    if args.model:
        top_k = int(AutoModelForCausalLM.from_pretrained(args.model).config.num_experts_per_tok)
    batch = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq))
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(**(SHAPE | {"intermediate_size": top_k * SHAPE["intermediate_size"]})))
    for name, p in dense.named_parameters():
        p.requires_grad_(".mlp." not in name)
    ref = step_tokens_per_s(dense, batch, args.steps)
    del dense
    print(f"dense, same active parameters (intermediate {top_k}×1536): {ref:8.1f} tok/s")
    for impl in args.impls.split(","):
        got = step_tokens_per_s(moe(args, impl), batch, args.steps)
        print(f"MoE mofe step, experts_implementation={impl:<11} {got:8.1f} tok/s  ratio {got / ref:.2f}× dense")


if __name__ == "__main__":
    main()
