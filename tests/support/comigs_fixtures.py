"""Shared helpers for the CoMiGS tests: a tiny llama base and users with synthetic token streams."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from conftest import save_dense
from moetool.methods.comigs.bilevel import UserData
from moetool.recipe.comigs import ComigsRecipe


def tiny_base(root: Path) -> Path:
    path = root / "base"
    if not (path / "config.json").is_file():
        save_dense(path, tie_word_embeddings=True)
    return path


def recipe(base: Path, specialists: tuple[int, ...] = (1, 3), **training: Any) -> ComigsRecipe:
    """Users u0, u1, ... with the given numbers of specialists; text data never read (tests pass UserData)."""
    users = [
        {"name": f"u{i}", "data": {"text": "unused.txt"}, "specialists": [{"name": f"u{i}-s{j}"} for j in range(n)]}
        for i, n in enumerate(specialists)
    ]
    t = {"rounds": 2, "local_iterations": 3, "router_every": 3, "router_steps": 2, "batch_size": 2, "seq_len": 12}
    return ComigsRecipe.model_validate(
        {
            "name": "t",
            "method": "comigs",
            "base_model": str(base),
            "lora": {"rank": 4, "attention_rank": 2},
            "users": users,
            "training": t | training,
        }
    )


def user_data(n_users: int, seed: int = 0) -> list[UserData]:
    """Per user: train tokens in [4, 150), valid tokens in [150, 250), test in [250, 300): splits are told apart by
    their ids alone."""
    g = torch.Generator().manual_seed(seed)
    return [
        UserData(
            train=torch.randint(4, 150, (400,), generator=g),
            valid=torch.randint(150, 250, (200,), generator=g),
            test=torch.randint(250, 300, (200,), generator=g),
        )
        for _ in range(n_users)
    ]


# Two users (one and two specialists) over text files a.txt and b.txt next to the recipe; {base}: the base model dir.
RECIPE_YAML = """\
name: {name}
method: comigs
base_model: {base}
lora: {{rank: 4, attention_rank: 2}}
users:
  - name: a
    data: {{text: a.txt}}
    specialists: [{{name: a1}}]
  - name: b
    data: {{text: b.txt}}
    specialists: [{{name: b1}}, {{name: b2}}]
training: {{rounds: 2, local_iterations: 2, router_every: 2, router_steps: 1, batch_size: 2, seq_len: 16}}
"""


def two_user_recipe(root: Path, name: str = "fl") -> Path:
    """RECIPE_YAML with its base and text files written under ``root``; returns the recipe's path."""
    from conftest import TEXT

    base = tiny_base(root)
    lines = TEXT.strip().splitlines()
    (root / "a.txt").write_text("\n\n".join(lines[0] + " " + lines[1] for _ in range(40)))
    (root / "b.txt").write_text("\n\n".join(lines[2] + " " + lines[1] for _ in range(40)))
    path = root / "r.yaml"
    path.write_text(RECIPE_YAML.replace("{name}", name).format(base=base))
    return path
