"""Execute a merge plan: compute routers, stream tensors into shards, write metadata, move into place."""

from __future__ import annotations

import gc
import json
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from moetool.arch.outputs import NULL_SHARED_GATE
from moetool.arch.released import released_config
from moetool.card import limits_section, model_card, provenance, source_hashes
from moetool.compute.dtypes import resolve_device
from moetool.io.atomic import atomic_dir, check_output
from moetool.io.checkpoint import Checkpoint
from moetool.io.files import copy_tokenizer
from moetool.io.safe import read_json
from moetool.io.writer import ShardedWriter
from moetool.methods.mofe.plan import DTYPES, MergePlan, Parts, TensorOp
from moetool.progress import silent, task
from moetool.recipe.kept import write_kept_recipe
from moetool.recipe.mofe import MoFERecipe
from moetool.routing import init as rinit

Routers = tuple[torch.Tensor, torch.Tensor | None]


def compute_router_weights(plan: MergePlan) -> Routers:
    """Router rows ``[L, E, H]`` and, with a shared expert, its gate rows ``[L, 1, H]`` (float32)."""

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
    # prompts longer than the base's context count only up to it (the plan warned, naming each one)
    tok.model_max_length = int(plan.config.get("max_position_embeddings") or tok.model_max_length)
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

    # float32 for the router rows' precision, on the plan's device (a GPU when there is one)
    device = resolve_device(plan.device)
    model: Any = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    model = model.to(device).eval()
    gates = rinit.hidden_gates(model, tok, sets, chat_template=recipe.chat_template)
    shared_gate = (
        rinit.hidden_gates(model, tok, shared_sets, chat_template=recipe.chat_template) if shared_sets else None
    )
    # freed as soon as the rows exist: the stream beside it holds one tensor at a time, so the peak is the base
    # model plus one tensor
    del model
    gc.collect()
    return gates, shared_gate


def _routers_and_warnings(plan: MergePlan) -> tuple[Routers, list[str]]:
    """:func:`compute_router_weights` with the warnings it raises about the router rows, for the caller to print
    (it runs in a worker thread)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        routers = compute_router_weights(plan)
    notes = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "router rows" in str(w.message)]
    return routers, notes


_ROUTING = ("router", "shared_gate")


def _stream_tensors(plan: MergePlan, tmp: Path, routers: Future[tuple[Routers, list[str]]], console: Console) -> None:
    """Read, cast and write every planned tensor, one at a time, into shards under ``tmp``. Router rows are written
    last, so the copies stream while ``routers`` is still being computed."""

    dtype = DTYPES[plan.dtype]
    ckpts: dict[str, Checkpoint] = {}
    ops = [op for op in plan.ops if op.kind not in _ROUTING] + [op for op in plan.ops if op.kind in _ROUTING]
    gates: torch.Tensor | None = None
    shared_gates: torch.Tensor | None = None
    layout = [(op.out, dtype, op.shape) for op in ops]
    try:
        need = 0  # the largest read, from the headers' byte counts
        for op in ops:
            if op.kind in ("copy", "expert", "shared"):
                assert op.source is not None and op.src is not None
                if op.source not in ckpts:
                    ckpts[op.source] = _open(plan, op.source)
                info = ckpts[op.source].tensors.get(op.src)  # a missing tensor is reported by get() below
                need = max(need, info.nbytes if info is not None else 0)
        scratch = torch.empty(need, dtype=torch.uint8)
        with (
            task(console, "writing tensors", len(plan.ops), unit="tensors") as advance,
            ShardedWriter(tmp, layout, plan.recipe.max_shard_size) as writer,
            ThreadPoolExecutor(1, thread_name_prefix="moetool-finite") as checker,
        ):
            for op in ops:
                if op.kind in _ROUTING and gates is None:
                    (gates, shared_gates), notes = routers.result()
                    for note in notes:
                        console.print(f"[yellow]warning:[/] {note}")
                checked: Future[torch.Tensor] | None = None
                if op.kind in ("copy", "expert", "shared"):
                    assert op.source is not None and op.src is not None
                    # one buffer serves every read: the tensor is written before the next one is read into it
                    t = ckpts[op.source].get(op.src, into=scratch)
                    # its NaN/Inf check runs while it is written (both release the GIL); a bad tensor still fails
                    # the merge before the output is moved into place
                    checked = checker.submit(ckpts[op.source].check, op.src, t)
                elif op.kind == "stacked":
                    t = _stacked(op.parts, ckpts, plan)
                else:
                    t = _made(op, gates, shared_gates)
                if tuple(t.shape) != op.shape:
                    raise RuntimeError(f"{op.out}: got shape {tuple(t.shape)}, planned {op.shape}")
                writer.add(op.out, t.to(dtype))
                if checked is not None:
                    checked.result()  # before the buffer takes the next tensor
                advance()
    finally:
        for c in ckpts.values():
            c.close()


def _made(op: TensorOp, gates: torch.Tensor | None, shared_gates: torch.Tensor | None) -> torch.Tensor:
    """A tensor no source holds: zeros, the null shared gate, a layer's router rows or its shared-expert gate."""
    if op.kind == "zeros":
        return torch.zeros(op.shape)
    if op.kind == "null_gate":
        return torch.full(op.shape, NULL_SHARED_GATE)
    layer = int(op.out.split(".")[2])
    if op.kind == "router":
        assert gates is not None
        return gates[layer]
    return shared_gates[layer] if shared_gates is not None else torch.zeros(op.shape)  # shared_gate


def _stacked(parts: Parts, ckpts: dict[str, Checkpoint], plan: MergePlan) -> torch.Tensor:
    """Every expert's tensors in one: per expert the listed tensors concatenated along dim 0, then stacked."""
    rows = []
    for expert in parts:
        for label, _ in expert:
            if label not in ckpts:
                ckpts[label] = _open(plan, label)
        rows.append(torch.cat([ckpts[label].check(src, ckpts[label].get(src)) for label, src in expert]))
    return torch.stack(rows)


def _open(plan: MergePlan, label: str) -> Checkpoint:
    """Source ``label``'s checkpoint for the stream, which checks each tensor for NaN/Inf itself (beside its write)."""
    return Checkpoint(plan.sources[label].path, allow_pickle=plan.allow_pickle, check_finite=False)


def _write_metadata(plan: MergePlan, tmp: Path, hashes: dict[Path, str] | None = None) -> None:
    """config.json, the base's tokenizer files, the recipe (the one kept form), moetool.json (provenance) and the
    model card."""

    recipe: MoFERecipe = plan.recipe
    cfg = released_config(plan.config) | {"dtype": plan.dtype}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    base_path = plan.sources["base"].path
    copy_tokenizer(base_path, tmp)
    recipe_text = write_kept_recipe(tmp, recipe)
    meta: dict[str, Any] = {
        "method": recipe.method,
        "name": recipe.name,
        "architecture": plan.arch.name,
        "experts": [e.name for e in recipe.experts],
        "shared_expert": recipe.shared_expert is not None,
        "experts_per_token": recipe.experts_per_token,
        "gate_mode": recipe.gate_mode,
        # the dense base's config: `moetool experts extract` gives an expert back as a model of exactly this family
        "base_config": read_json(base_path / "config.json", what="model config"),
        "provenance": provenance(plan.sources, recipe_text, allow_pickle=plan.allow_pickle, hashes=hashes),
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
        extra_sections=limits_section(plan.config),
    )
    (tmp / "README.md").write_text(card)


def execute(plan: MergePlan, out: Path, *, force: bool = False, console: Console | None = None) -> Path:
    """Write the merged checkpoint to ``out`` atomically.

    Raises:
        OutputExistsError: ``out`` exists and ``force`` is False (checked before any work).
    """
    console = console if console is not None else silent()
    out = Path(out)
    check_output(out, force=force)
    # the router computation (a base forward pass for hidden gates) and the sources' hashes (a full read of every
    # input) run beside the tensor stream: torch, file reads and hashing release the GIL
    for note in plan.warnings:
        console.print(f"[yellow]warning:[/] {note}")
    console.print(f"computing routers ({plan.recipe.gate_mode}) …")
    pool = ThreadPoolExecutor(2, thread_name_prefix="moetool-merge")
    try:
        routers = pool.submit(_routers_and_warnings, plan)
        hashes = pool.submit(source_hashes, plan.sources, allow_pickle=plan.allow_pickle)
        with atomic_dir(out, force=force) as tmp:
            _stream_tensors(plan, tmp, routers, console)
            _write_metadata(plan, tmp, hashes.result())
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return out
