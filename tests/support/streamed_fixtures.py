"""What the streamed graph-export tests share: a deep, narrow bf16 MoE (one layer a small part of it) and a count of
the tensor memory alive in the process."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from tuning_fixtures import write_tuning_recipe

from conftest import save_dense
from moetool.api import assemble


def deep_moe(root: Path) -> Path:
    """A bf16 MoE of 8 layers (3 experts), deep and narrow as real models are: one layer is a small part of it."""
    kw = {"num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 128, "tie_word_embeddings": True}
    base = save_dense(root / "base", **kw)
    family = {"base": base} | {f"e{i}": save_dense(root / f"e{i}", seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)}
    recipe = write_tuning_recipe(root, family, steps=1)
    recipe.write_text(recipe.read_text().replace("gate_mode: random\n", "gate_mode: random\ndtype: bfloat16\n"))
    return assemble(recipe, root / "moe")


def live_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage alive in this process (each storage once)."""
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        # plain tensors and parameters only: a trace leaves fake tensors around, which hold no memory
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total
