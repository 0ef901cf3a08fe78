"""MoFE claim check: trainable parameters under `mofe` freezing vs expert count, and step time vs full fine-tuning.

For 2, 4 and 8 experts, builds a Mixtral MoE (default: hidden 256, 4 layers, intermediate 688, vocab 4096) and
reports the trainable / frozen parameter counts under the `mofe` preset, then times training steps (forward, backward,
AdamW step) with `mofe` freezing and with every parameter trainable, printing the ratio.

Run:  .venv/bin/python bench/mofe_trainable.py [--steps 10] [--hidden 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from moetool.train.freeze import apply_freeze


def step_time(model: torch.nn.Module, preset: str, steps: int, batch: torch.Tensor) -> float:
    apply_freeze(model, preset)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # warm-up steps excluded
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    batch = torch.randint(0, 4096, (args.batch, args.seq))
    print(
        f"Mixtral hidden {args.hidden}, {args.layers} layers, top-2; batch {args.batch}x{args.seq}; "
        f"{torch.get_num_threads()} threads"
    )
    header = f"{'experts':>7} {'total':>12} {'trainable':>12} {'of which routers':>17} {'frozen':>12}"
    print(header + f" {'mofe s/step':>12} {'full s/step':>12} {'mofe/full':>10}")
    base = None
    for n in (2, 4, 8):
        cfg = MixtralConfig(
            vocab_size=4096,
            hidden_size=args.hidden,
            intermediate_size=int(args.hidden * 2.6875),
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=n,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
        model = MixtralForCausalLM(cfg)
        rep = apply_freeze(model, "mofe")
        routers = args.layers * n * args.hidden
        t_mofe = step_time(model, "mofe", args.steps, batch)
        t_full = step_time(model, "full", args.steps, batch)
        total = rep.trainable_params + rep.frozen_params
        print(
            f"{n:>7} {total:>12,} {rep.trainable_params:>12,} {routers:>17,} {rep.frozen_params:>12,}"
            f" {t_mofe:>12.3f} {t_full:>12.3f} {t_mofe / t_full:>10.2f}"
        )
        non_router = rep.trainable_params - routers
        if base is None:
            base = non_router
        assert non_router == base, "non-router trainable parameters must not depend on the expert count"
    print("\nTrainable parameters apart from the routers (L·E·H) are the same for every expert count, as MoFE claims;")
    print("the router rows are the only trainable part that grows with experts.")


if __name__ == "__main__":
    main()
