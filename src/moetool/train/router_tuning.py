"""``moetool train``: brief tuning of an assembled MoE with its experts frozen (MoFE), on accelerate.

init → setup (model, freeze, data, optimizer) → train (resumable) → save (atomic, same format as merge).
The same code runs on CPU, one GPU, or several under ``accelerate launch``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from safetensors.torch import load_file, save_file

from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir, check_output
from moetool.io.files import copy_tokenizer
from moetool.io.safe import read_json
from moetool.progress import silent, task
from moetool.recipe.mofe import MoFERecipe
from moetool.recipe.train import TrainSpec
from moetool.routing.losses import expert_load, routing_entropy, routing_losses
from moetool.routing.tap import RouterTap
from moetool.train.data import load_source, sample_batch, tokenize_stream
from moetool.train.freeze import FreezeReport, apply_freeze

CHECKPOINT_FORMAT = 1


@dataclass
class TrainResult:
    output: Path
    steps: int
    freeze: FreezeReport
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    resumed_from: int = 0


def _lr_lambda(spec: TrainSpec) -> Callable[[int], float]:
    def fn(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / (spec.warmup_steps + 1)
        if spec.schedule == "constant":
            return 1.0
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        if spec.schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


def make_optimizer(model: torch.nn.Module, spec: TrainSpec) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: routers in their own group at ``router_learning_rate``."""
    params = [p for p in model.parameters() if p.requires_grad]
    router_ids = {id(r.weight) for r in RouterTap.find_routers(model)}
    groups = [
        {"params": [p for p in params if id(p) not in router_ids], "lr": spec.learning_rate},
        {"params": [p for p in params if id(p) in router_ids], "lr": spec.router_learning_rate or spec.learning_rate},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=spec.weight_decay)


def checkpoint_dir(output: Path) -> Path:
    """Where a run writing ``output`` keeps its resumable state (removed after success)."""
    return output.parent / f".{output.name}.moetool-train"


def _save_checkpoint(
    ckpt: Path,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    history: list[dict[str, Any]],
    fingerprint: str,
) -> None:
    """Trainable tensors and AdamW moments as safetensors, counters as JSON; no pickle. Written atomically."""
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = {p: n for n, p in model.named_parameters() if p.requires_grad}
    save_file({n: p.detach().cpu().contiguous() for p, n in names.items()}, str(tmp / "trainable.safetensors"))
    moments: dict[str, torch.Tensor] = {}
    for p, n in names.items():
        for k, v in opt.state.get(p, {}).items():
            moments[f"{n}::{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
    save_file(moments, str(tmp / "optimizer.safetensors"))
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "scheduler": sched.state_dict(),
        "history": history,
        "fingerprint": fingerprint,
    }
    (tmp / "state.json").write_text(json.dumps(state))
    shutil.rmtree(ckpt, ignore_errors=True)
    tmp.rename(ckpt)


def _load_checkpoint(
    ckpt: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, fingerprint: str
) -> tuple[int, list[dict[str, Any]]]:
    try:
        state = read_json(ckpt / "state.json", what="router-tuning checkpoint state", error=MoetoolError)
    except MoetoolError as exc:
        raise MoetoolError(f"{exc}; pass --no-resume to start over") from None
    if state.get("format") != CHECKPOINT_FORMAT or state.get("fingerprint") != fingerprint:
        raise MoetoolError(
            f"{ckpt} belongs to a different run (recipe, model or freeze changed); pass --no-resume to start over"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in load_file(str(ckpt / "trainable.safetensors")).items():
            params[n].copy_(t)
    moments = load_file(str(ckpt / "optimizer.safetensors"))
    for n, p in params.items():
        st = {k.split("::", 1)[1]: v.to(p.device) for k, v in moments.items() if k.split("::", 1)[0] == n}
        if st:
            opt.state[p] = st
    sched.load_state_dict(state["scheduler"])
    # the scheduler writes the lr into the optimizer only when it steps; restore the lr it last set
    for group, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
        group["lr"] = lr
    return int(state["step"]), list(state["history"])


def _card_section(recipe: MoFERecipe, report: FreezeReport, history: list[dict[str, Any]], steps: int) -> str:
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


@dataclass
class _Run:
    """Everything one tuning run holds: model, data, optimizer and where it resumes."""

    accelerator: Any
    model: Any
    opt: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    tap: RouterTap
    streams: list[torch.Tensor]
    params: list[torch.nn.Parameter]
    report: FreezeReport
    bos: int | None
    fingerprint: str
    start: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def _setup(recipe: MoFERecipe, model_dir: Path, console: Console) -> _Run:
    """Load the MoE, apply the freeze spec, tokenize the training data, make the optimizer and schedule."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec: TrainSpec = recipe.train
    accelerator = Accelerator(gradient_accumulation_steps=spec.grad_accum)
    set_seed(spec.seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    report = apply_freeze(model, recipe.freeze.preset, recipe.freeze.trainable, recipe.freeze.frozen)
    if accelerator.is_main_process:
        console.print(
            f"parameters: [bold]{report.trainable_params:,}[/] trainable, {report.frozen_params:,} frozen "
            f"({len(report.trainable)} trainable tensors; preset {recipe.freeze.preset})"
        )
    streams = []
    for name, src in spec.data.items():
        train_text, _ = load_source(
            name, src, base_dir=recipe.recipe_dir, fraction=spec.validation_fraction, seed=spec.seed
        )
        streams.append(tokenize_stream(tok, train_text))
    opt = make_optimizer(model, spec)
    fingerprint = json.dumps([recipe.train.model_dump(), recipe.freeze.model_dump(), str(model_dir.resolve())])
    return _Run(
        accelerator=accelerator,
        model=model,
        opt=opt,
        sched=torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(spec)),
        tap=RouterTap(model, spec.router_jitter),
        streams=streams,
        params=[p for p in model.parameters() if p.requires_grad],
        report=report,
        bos=tok.bos_token_id,
        fingerprint=fingerprint,
    )


def _step(run: _Run, prepared: Any, spec: TrainSpec, step: int, top_k: int) -> tuple[dict[str, float], int]:
    """One optimizer step over ``grad_accum`` micro-batches; returns the mean losses and the tokens seen."""
    acc = run.accelerator
    agg = {"ce": 0.0, "lb": 0.0, "z": 0.0}
    tokens = 0
    for micro in range(spec.grad_accum):
        seed = spec.seed + 7919 * acc.process_index
        batch = sample_batch(
            run.streams, spec.batch_size, spec.seq_len, seed=seed, step=step * spec.grad_accum + micro, bos_id=run.bos
        ).to(acc.device)
        run.tap.generator.manual_seed(seed * 31 + step * spec.grad_accum + micro)
        run.tap.logits.clear()
        with acc.accumulate(prepared.model):
            out = prepared.model(input_ids=batch, labels=batch, use_cache=False)
            lb, z = routing_losses(run.tap.logits, top_k)
            loss = out.loss + spec.load_balancing_coef * lb + spec.z_loss_coef * z
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(run.params, spec.max_grad_norm)
            prepared.opt.step()
            prepared.opt.zero_grad()
        agg["ce"] += out.loss.item() / spec.grad_accum
        agg["lb"] += lb.item() / spec.grad_accum
        agg["z"] += z.item() / spec.grad_accum
        tokens += batch.numel()
    run.sched.step()
    return agg, tokens


@dataclass
class _Prepared:
    model: Any
    opt: Any


def _loop(
    run: _Run,
    spec: TrainSpec,
    ckpt: Path,
    console: Console,
    callback: Callable[[int, dict[str, Any]], None] | None,
) -> tuple[Any, float]:
    """Steps from ``run.start`` to ``spec.steps``: metrics every ``log_every``, checkpoints every ``checkpoint_every``."""
    acc = run.accelerator
    model, opt = acc.prepare(run.model, run.opt)
    prepared = _Prepared(model, opt)
    model.train()
    top_k = run.model.config.num_experts_per_tok
    t0, tokens = time.perf_counter(), 0
    shown = console if acc.is_main_process else Console(quiet=True)
    with task(shown, "router tuning", spec.steps, unit="steps") as advance:
        advance(run.start)
        for step in range(run.start, spec.steps):
            agg, n = _step(run, prepared, spec, step, top_k)
            tokens += n
            done = step + 1
            metrics: dict[str, Any] = {
                "step": done,
                "loss": agg["ce"] + spec.load_balancing_coef * agg["lb"] + spec.z_loss_coef * agg["z"],
                **agg,
                "lr": run.sched.get_last_lr()[0],
            }
            info = f"loss {metrics['loss']:.3f} ce {agg['ce']:.3f} lb {agg['lb']:.3f}"
            if done % spec.log_every == 0 or done == spec.steps:
                with torch.no_grad():
                    metrics["entropy"] = float(torch.stack([routing_entropy(x) for x in run.tap.logits]).mean())
                    metrics["load"] = torch.stack([expert_load(x, top_k) for x in run.tap.logits]).mean(0).tolist()
                metrics["tokens_per_s"] = tokens / max(1e-9, time.perf_counter() - t0)
                run.history.append(metrics)
                load = " ".join(f"{x:.2f}" for x in metrics["load"])
                info += f" | {metrics['tokens_per_s']:.0f} tok/s | H {metrics['entropy']:.2f} | load {load}"
            advance(1, info)
            if acc.is_main_process and (done % spec.checkpoint_every == 0 and done < spec.steps):
                _save_checkpoint(ckpt, done, acc.unwrap_model(model), run.opt, run.sched, run.history, run.fingerprint)
            if callback is not None:
                callback(done, metrics)
    return model, time.perf_counter() - t0


def train_router(
    recipe: MoFERecipe,
    model_dir: str | Path,
    output: str | Path,
    *,
    force: bool = False,
    resume: bool = True,
    console: Console | None = None,
    callback: Callable[[int, dict[str, Any]], None] | None = None,
    preset: str | None = None,
) -> TrainResult:
    """Tune an assembled MoE as the recipe's ``freeze:`` and ``train:`` sections say; write it to ``output``.

    Args:
        recipe: the validated recipe (:func:`moetool.recipe.load_recipe`) with ``freeze:`` and ``train:``.
        callback: called after every optimizer step with (step, metrics); raising from it interrupts the run
            (the last checkpoint remains, and the next call resumes from it).
        preset: overrides the recipe's ``freeze.preset``.

    Raises:
        MoetoolError: bad model, data or freeze patterns; an existing output without ``force``.
    """
    console = console if console is not None else silent()
    model_dir, output = Path(model_dir), Path(output)
    if getattr(recipe, "train", None) is None or getattr(recipe, "freeze", None) is None:
        raise MoetoolError(f"recipe {recipe.name!r}: router tuning needs train: and freeze: sections")
    if preset is not None:
        recipe = recipe.model_copy(update={"freeze": recipe.freeze.model_copy(update={"preset": preset})})
    spec: TrainSpec = recipe.train
    check_output(output, force=force)
    if not (model_dir / "config.json").is_file():
        raise MoetoolError(f"--model: {model_dir} is not a checkpoint directory")
    run = _setup(recipe, model_dir, console)
    ckpt = checkpoint_dir(output)
    if ckpt.exists() and resume:
        run.start, run.history = _load_checkpoint(ckpt, run.model, run.opt, run.sched, run.fingerprint)
        console.print(f"resuming from step {run.start} ({ckpt})")
    elif ckpt.exists():
        shutil.rmtree(ckpt)
    prepared_model, seconds = _loop(run, spec, ckpt, console, callback)
    run.tap.remove()
    run.accelerator.wait_for_everyone()
    result = TrainResult(output, spec.steps, run.report, run.history, seconds, run.start)
    if run.accelerator.is_main_process:
        model = run.accelerator.unwrap_model(prepared_model)
        _write_output(model, model_dir, output, recipe, run.report, run.history, seconds, force)
        shutil.rmtree(ckpt, ignore_errors=True)
    return result


def _write_output(
    model: Any,
    model_dir: Path,
    output: Path,
    recipe: MoFERecipe,
    report: FreezeReport,
    history: list[dict[str, Any]],
    seconds: float,
    force: bool,
) -> None:
    model.eval()
    with atomic_dir(output, force=force) as tmp:
        # transformers re-saves a model loaded from per-expert tensors in that same per-expert layout
        model.save_pretrained(str(tmp), max_shard_size="2GB")
        copy_tokenizer(model_dir, tmp, overwrite=False)
        (tmp / "moetool-train-recipe.yaml").write_text(recipe.text, encoding="utf-8")
        for f in ("moetool-recipe.yaml",):
            if (model_dir / f).is_file():
                shutil.copy2(model_dir / f, tmp / f)
        meta_path = model_dir / "moetool.json"
        meta = read_json(meta_path, what="moetool metadata") if meta_path.is_file() else {}
        meta["training"] = {
            "source_model": str(model_dir.resolve()),
            "steps": recipe.train.steps,
            "seconds": round(seconds, 1),
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
        card = re.sub(r"## Router tuning\n\n.*?\n\n(?=## |\Z)", "", card, flags=re.S)
        section = _card_section(recipe, report, history, recipe.train.steps)
        card = card.replace("## Recipe\n", section + "## Recipe\n", 1) if "## Recipe\n" in card else card + section
        (tmp / "README.md").write_text(card)
