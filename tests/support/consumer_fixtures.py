"""Merged MoE folders of every output architecture, and their logits in transformers and in mlx-lm."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from conftest import write_recipe
from moetool.api import assemble

SHARED = "shared_expert: {{source: {base}, positive_prompts: ['def']}}\n"
# name: (dense family, recipe lines): every output architecture, each with its own checkpoint-to-module conversions
MOE_CASES: dict[str, tuple[str, str]] = {
    "mixtral": ("llama", ""),
    "qwen2_moe-shared": ("qwen2", SHARED),
    "qwen3_moe": ("qwen3", ""),
    "granitemoe": ("granite", ""),
}


def bf16_copy(folder: Path) -> Path:
    """The folder's weights rewritten in bf16 (the layout a real checkpoint ships)."""
    from safetensors.torch import load_file, save_file

    for f in folder.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    return folder


def merge(tmp: Path, m: dict[str, Path], case: str, extra: str = "") -> Path:
    """A 3-expert top-2 MoE of ``case``'s architecture from tiny models ``m``."""
    arch = case.split("-", maxsplit=1)[0]
    experts = "".join(
        f"  - {{name: x{i}, source: {m[f'e{i}']}, positive_prompts: ['{p}']}}\n"
        for i, p in ((1, "def main():"), (2, "Permission is hereby granted"), (3, "acute bronchitis"))
    )
    text = (
        f"name: {case}\nmethod: mofe\nbase_model: {m['base']}\narchitecture: {arch}\nexperts_per_token: 2\n"
        f"{extra.format(base=m['base'])}experts:\n{experts}"
    )
    return assemble(write_recipe(tmp / f"{case}.yaml", text), tmp / case)


def hf_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """transformers float32 logits ``[T, V]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def mlx_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """mlx-lm's logits ``[T, V]`` for the folder, loaded by mlx-lm's own loader (float32 weights as written)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))
