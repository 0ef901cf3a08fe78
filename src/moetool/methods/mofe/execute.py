"""Execute a merge plan: compute routers, stream tensors into shards, write metadata, move into place."""

from __future__ import annotations

import gc
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moetool.io.atomic import atomic_dir, check_output
from moetool.io.checkpoint import Checkpoint
from moetool.methods.base import DTYPES, MergePlan
from moetool.recipe.mofe import MoFERecipe

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def compute_router_weights(plan: MergePlan) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Router rows ``[L, E, H]`` and, with a shared expert, its gate rows ``[L, 1, H]`` (float32)."""
    from moetool.routing import init as rinit

    recipe: MoFERecipe = plan.recipe
    n_layers = plan.config["num_hidden_layers"]
    hidden = plan.config["hidden_size"]
    sets = [(e.positive_prompts, e.negative_prompts) for e in recipe.experts]
    shared = recipe.shared_expert
    shared_sets = [(shared.positive_prompts, shared.negative_prompts)] if shared and shared.positive_prompts else []
    base_path = plan.sources["base"].path
    if recipe.gate_mode == "random":
        gates = rinit.random_gates(n_layers, len(sets), hidden, seed=recipe.seed)
        shared_gate = None
        if shared_sets:
            shared_gate = rinit.random_gates(n_layers, 1, hidden, seed=recipe.seed + 1)
        return gates, shared_gate
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_path))
    if recipe.gate_mode == "cheap_embed":
        ck = Checkpoint(base_path, allow_pickle=plan.allow_pickle)
        embed = ck.get("model.embed_tokens.weight")
        gates = rinit.cheap_embed_gates(embed, tok, sets, n_layers, chat_template=recipe.chat_template)
        shared_gate = (
            rinit.cheap_embed_gates(embed, tok, shared_sets, n_layers, chat_template=recipe.chat_template)
            if shared_sets
            else None
        )
        return gates, shared_gate
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32).eval()
    gates = rinit.hidden_gates(model, tok, sets, chat_template=recipe.chat_template)
    shared_gate = (
        rinit.hidden_gates(model, tok, shared_sets, chat_template=recipe.chat_template) if shared_sets else None
    )
    # freed before tensors stream, so peak memory is the base or one tensor, not both
    del model
    gc.collect()
    return gates, shared_gate


def execute(
    plan: MergePlan, out: Path, *, force: bool = False, recipe_text: str = "", console: Console | None = None
) -> Path:
    """Write the merged checkpoint to ``out`` atomically.

    Raises:
        OutputExistsError: ``out`` exists and ``force`` is False (checked before any work).
    """
    from moetool.card import model_card, provenance

    console = console or Console(stderr=True)
    out = Path(out)
    check_output(out, force=force)
    for note in plan.warnings:
        console.print(f"[yellow]warning:[/] {note}")
    recipe: MoFERecipe = plan.recipe
    console.print(f"computing routers ({recipe.gate_mode}) …")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gates, shared_gates = compute_router_weights(plan)
    for w in caught:
        if issubclass(w.category, UserWarning) and "router rows" in str(w.message):
            console.print(f"[yellow]warning:[/] {w.message}")
    dtype = DTYPES[plan.dtype]
    ckpts: dict[str, Checkpoint] = {}

    def checkpoint(label: str) -> Checkpoint:
        if label not in ckpts:
            ckpts[label] = Checkpoint(plan.sources[label].path, allow_pickle=plan.allow_pickle)
        return ckpts[label]

    from moetool.io.writer import ShardedWriter

    with atomic_dir(out, force=force) as tmp:
        progress = Progress(
            TextColumn("writing tensors"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        layout = [(op.out, dtype, op.shape) for op in plan.ops]
        with progress, ShardedWriter(tmp, layout, recipe.max_shard_size) as writer:
            task = progress.add_task("write", total=len(plan.ops))
            for op in plan.ops:
                if op.kind in ("copy", "expert", "shared"):
                    assert op.source is not None and op.src is not None
                    t = checkpoint(op.source).get(op.src)
                elif op.kind == "zeros":
                    t = torch.zeros(op.shape)
                elif op.kind == "router":
                    layer = int(op.out.split(".")[2])
                    t = gates[layer]
                else:  # shared_gate
                    layer = int(op.out.split(".")[2])
                    t = shared_gates[layer] if shared_gates is not None else torch.zeros(op.shape)
                if tuple(t.shape) != op.shape:
                    raise RuntimeError(f"{op.out}: got shape {tuple(t.shape)}, planned {op.shape}")
                writer.add(op.out, t.to(dtype))
                progress.advance(task)
        for c in ckpts.values():
            c.close()
        cfg = dict(plan.config) | {"dtype": plan.dtype}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        base_path = plan.sources["base"].path
        for f in TOKENIZER_FILES:
            if (base_path / f).is_file():
                shutil.copy2(base_path / f, tmp / f)
        (tmp / "moetool-recipe.yaml").write_text(recipe_text)
        meta: dict[str, Any] = {
            "method": recipe.method,
            "name": recipe.name,
            "architecture": plan.arch.name,
            "experts": [e.name for e in recipe.experts],
            "shared_expert": recipe.shared_expert is not None,
            "experts_per_token": recipe.experts_per_token,
            "gate_mode": recipe.gate_mode,
            "provenance": provenance(plan.sources, recipe_text, allow_pickle=plan.allow_pickle),
        }
        (tmp / "moetool.json").write_text(json.dumps(meta, indent=2))
        card = model_card(
            name=recipe.name,
            method=recipe.method,
            arch=plan.arch.name,
            experts=meta["experts"],
            top_k=recipe.experts_per_token,
            gate_mode=recipe.gate_mode,
            sources=plan.sources,
            recipe_text=recipe_text,
        )
        (tmp / "README.md").write_text(card)
    return out
