"""The tuned model's folder: weights, tokenizer, recipes, ``moetool.json`` with the training record, and the card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from moetool.card import put_section
from moetool.io.atomic import atomic_dir
from moetool.io.files import copy_tokenizer
from moetool.io.safe import read_json
from moetool.recipe.kept import KEPT_RECIPE
from moetool.recipe.mofe import MoFERecipe
from moetool.recipe.train import TrainSpec, TuningRecipe
from moetool.train.freeze import FreezeReport
from moetool.train.precision import dtype_name


def card_section(
    recipe: MoFERecipe | TuningRecipe, report: FreezeReport, history: list[dict[str, Any]], steps: int
) -> str:
    """The model card's "Router tuning" section."""
    spec: TrainSpec = recipe.train
    last = history[-1] if history else {}
    return (
        "## Router tuning\n\n"
        f"Tuned with `moetool train` for {steps} steps (lr {spec.learning_rate}, {spec.schedule} schedule, batch "
        f"{spec.batch_size}×{spec.seq_len} tokens × {spec.grad_accum} accumulation) on domains "
        f"{', '.join(spec.data)}; freeze preset `{recipe.freeze.preset}`: {report.trainable_params:,} trainable and "
        f"{report.frozen_params:,} frozen parameters. Losses: LM + {spec.load_balancing_coef}·load-balancing + "
        f"{spec.z_loss_coef}·z-loss (router jitter {spec.router_jitter}). "
        f"Final training loss {last.get('loss', float('nan')):.4f}.\n\n"
    )


def write_output(
    model: Any,
    model_dir: Path,
    output: Path,
    recipe: MoFERecipe | TuningRecipe,
    report: FreezeReport,
    history: list[dict[str, Any]],
    seconds: float,
    force: bool,
    processes: int = 1,
) -> None:
    """Write the tuned ``model`` (unwrapped) to ``output`` atomically, in the same format as ``moetool merge``."""
    model.eval()
    with atomic_dir(output, force=force) as tmp:
        # transformers re-saves a model loaded from per-expert tensors in that same per-expert layout
        model.save_pretrained(str(tmp), max_shard_size="2GB")
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
            "processes": processes,
            "dtype": dtype_name(next(iter(model.parameters())).dtype),
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
