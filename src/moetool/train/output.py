"""The tuned model's folder: weights, tokenizer, recipes, ``moetool.json`` with the training record, and the card.

The weights are the input checkpoint's, tensor by tensor, with the tuned ones put in their place: the frozen
experts are copied (cast to the run's dtype when it differs), never gathered into one process, so a model sharded
over processes is written by the main one holding one tensor at a time plus the tuned tensors.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moetool.card import put_section
from moetool.compute.dtypes import dtype_name
from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir
from moetool.io.checkpoint import SAFETENSORS_DTYPES, Checkpoint
from moetool.io.files import copy_tokenizer
from moetool.io.safe import read_json
from moetool.io.writer import ShardedWriter
from moetool.recipe.kept import KEPT_RECIPE
from moetool.recipe.mofe import MoFERecipe
from moetool.recipe.train import TrainSpec, TuningRecipe
from moetool.train.checkpoint import StepRecord
from moetool.train.freeze import FreezeReport
from moetool.train.sharded import full

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

SHARD_BYTES = 2 << 30


def tuned_tensors(model: PreTrainedModel, dtype: torch.dtype, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The trainable tensors of ``model`` (unwrapped; sharded or not) in ``dtype``, under the checkpoint's names
    (transformers' conversions reverted: ``mlp.gate`` → ``block_sparse_moe.gate``), a tied weight under each of its
    names. Every process calls this (a sharded tensor is gathered from all); only one with ``keep`` holds the result
    (the others get ``{}``)."""
    from transformers.core_model_loading import revert_weight_conversion

    tuned: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}
    done: set[int] = set()  # a tied weight is gathered once, by every process alike
    for n, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        if id(p) not in done:
            done.add(id(p))
            whole = full(p).to(dtype)  # one float32 tensor at a time, narrowed at once
            if keep:
                gathered[id(p)] = whole
        if keep:
            tuned[n] = gathered[id(p)]
    return dict(revert_weight_conversion(model, tuned)) if keep else {}


def write_weights(model_dir: Path, out: Path, tuned: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """The input checkpoint's tensors with ``tuned`` in their place, floating point ones in ``dtype``, to ``out``.

    Raises:
        MoetoolError: a tuned tensor has no place in the checkpoint (named).
    """
    ck = Checkpoint(Path(model_dir))
    infos = ck.tensors
    # a tied weight is tuned under each of its names and stored under one (or, written by another tool, both)
    written = {id(t) for n, t in tuned.items() if n in infos}
    stray = sorted(n for n, t in tuned.items() if n not in infos and id(t) not in written)
    if stray:
        raise MoetoolError(f"{model_dir}: the tuned tensor {stray[0]} is not in the checkpoint it was loaded from")
    entries = []
    for name, info in infos.items():  # the layout from the headers alone, before any tensor is read
        stored = SAFETENSORS_DTYPES[info.dtype][0]
        entries.append((name, dtype if stored.is_floating_point else stored, tuple(info.shape)))
    try:
        with ShardedWriter(out, entries, SHARD_BYTES) as writer:
            for name, want, _ in entries:
                t = tuned[name] if name in tuned else ck.get(name)
                writer.add(name, t.to(want))
    finally:
        ck.close()


def card_section(recipe: MoFERecipe | TuningRecipe, report: FreezeReport, history: list[StepRecord], steps: int) -> str:
    """The model card's "Router tuning" section."""
    spec: TrainSpec = recipe.train
    final = history[-1]["loss"] if history else float("nan")
    return (
        "## Router tuning\n\n"
        f"Tuned with `moetool train` for {steps} steps (lr {spec.learning_rate}, {spec.schedule} schedule, batch "
        f"{spec.batch_size}×{spec.seq_len} tokens × {spec.grad_accum} accumulation) on domains "
        f"{', '.join(spec.data)}; freeze preset `{recipe.freeze.preset}`: {report.trainable_params:,} trainable and "
        f"{report.frozen_params:,} frozen parameters. Losses: LM + {spec.load_balancing_coef}·load-balancing + "
        f"{spec.z_loss_coef}·z-loss (router jitter {spec.router_jitter}). "
        f"Final training loss {final:.4f}.\n\n"
    )


def write_output(
    tuned: dict[str, torch.Tensor],
    config: PretrainedConfig,
    model_dir: Path,
    output: Path,
    recipe: MoFERecipe | TuningRecipe,
    report: FreezeReport,
    history: list[StepRecord],
    seconds: float,
    force: bool,
    *,
    dtype: torch.dtype,
    processes: Mapping[str, object],
) -> None:
    """Write the tuned model to ``output`` atomically, in the same format as ``moetool merge``: the input's tensors
    with ``tuned`` (:func:`tuned_tensors`) in place, all in ``dtype``; ``config`` the model's (a transformers
    ``PretrainedConfig``); ``processes`` the launch's record for ``moetool.json`` (count, sharding, peaks)."""
    with atomic_dir(output, force=force) as tmp:
        write_weights(model_dir, tmp, tuned, dtype)
        config.dtype = dtype
        config.save_pretrained(str(tmp))
        if (model_dir / "generation_config.json").is_file():
            shutil.copy2(model_dir / "generation_config.json", tmp / "generation_config.json")
        copy_tokenizer(model_dir, tmp, overwrite=False)
        (tmp / "moetool-train-recipe.yaml").write_text(recipe.text, encoding="utf-8")
        if (model_dir / KEPT_RECIPE).is_file():  # the merged model's recipe, kept as it was written
            shutil.copy2(model_dir / KEPT_RECIPE, tmp / KEPT_RECIPE)
        meta_path = model_dir / "moetool.json"
        meta = read_json(meta_path, what="moetool metadata") if meta_path.is_file() else {}
        meta["training"] = {
            "source_model": str(model_dir.resolve()),
            "steps": recipe.train.steps,
            "seconds": round(seconds, 1),
            **processes,
            "dtype": dtype_name(dtype),
            "freeze": {
                "preset": recipe.freeze.preset,
                "trainable_params": report.trainable_params,
                "frozen_params": report.frozen_params,
            },
            "train": recipe.train.model_dump(),
            "history": history,
        }
        (tmp / "moetool.json").write_text(json.dumps(meta, indent=2))
        card_path = model_dir / "README.md"
        card = card_path.read_text() if card_path.is_file() else "# MoE model\n\n"
        body = card_section(recipe, report, history, recipe.train.steps).removeprefix("## Router tuning\n\n")
        card = put_section(card, "Router tuning", body)
        (tmp / "README.md").write_text(card)
