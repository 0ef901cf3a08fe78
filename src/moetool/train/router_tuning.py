"""``moetool train``: brief tuning of an assembled MoE with its experts frozen (MoFE), on accelerate.

init → setup (model, freeze, data, optimizer) → train (resumable) → save (atomic, same format as merge).
The same code runs on CPU, one GPU, or several data-parallel processes under ``accelerate launch`` / ``torchrun``
(:mod:`moetool.train.distributed`: the global batch is split, never repeated, and the result does not depend on the
process count beyond float summation order). Checkpoints (:mod:`moetool.train.checkpoint`) and the output
(:mod:`moetool.train.output`) are written once, by the main process.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from moetool.compute.dtypes import dtype_name, resolve_device, resolve_dtype
from moetool.errors import MoetoolError
from moetool.io.atomic import check_output
from moetool.progress import silent, task
from moetool.recipe.mofe import MoFERecipe
from moetool.recipe.train import TrainSpec, TuningRecipe
from moetool.routing.losses import expert_load, routing_entropy, routing_losses
from moetool.routing.tap import RouterTap
from moetool.train.checkpoint import StepRecord, checkpoint_dir, load_checkpoint, model_content_key, save_checkpoint
from moetool.train.data import load_source, sample_batch, tokenize_stream
from moetool.train.distributed import (
    launch_of,
    local_micro_batches,
    make_accelerator,
    process_record,
    reduce_sum,
    single_cpu_launch,
)
from moetool.train.freeze import FreezeReport, apply_freeze
from moetool.train.output import tuned_tensors, write_output
from moetool.train.precision import Arithmetic, arithmetic_for, keep_trainable_float32, tuning_need
from moetool.train.sharded import any_process, fsdp_requested, load_sharded

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel

__all__ = ["TrainResult", "checkpoint_dir", "make_optimizer", "train_router"]


@dataclass
class TrainResult:
    output: Path
    steps: int
    freeze: FreezeReport
    history: list[StepRecord] = field(default_factory=list)
    seconds: float = 0.0
    resumed_from: int = 0
    main_process: bool = True  # False in the other processes of a multi-process launch (they write nothing)


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


@dataclass
class _Run:
    """Everything one tuning run holds: model, data, optimizer, this process's micro-batches and where it resumes."""

    accelerator: Accelerator
    model: PreTrainedModel
    opt: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    tap: RouterTap
    streams: list[torch.Tensor]
    params: list[torch.nn.Parameter]
    report: FreezeReport
    bos: int | None
    fingerprint: str
    micro: range
    arithmetic: Arithmetic  # the frozen weights' dtype and how the forward computes over them
    sharded: bool = False  # FSDP2: every process holds a slice of each weight (moetool.train.sharded)
    start: int = 0
    history: list[StepRecord] = field(default_factory=list)


def _load(
    recipe: MoFERecipe | TuningRecipe, model_dir: Path, accelerator: Accelerator, dtype: torch.dtype, sharded: bool
) -> tuple[PreTrainedModel, FreezeReport, Arithmetic]:
    """The MoE in ``dtype`` with the freeze spec applied (trainable weights float32), whole or sharded."""
    from transformers import AutoModelForCausalLM

    freeze = (recipe.freeze.preset, recipe.freeze.trainable, recipe.freeze.frozen)
    if sharded:
        arithmetic = arithmetic_for(None, dtype, accelerator.device, sharded=True)
        model, report = load_sharded(
            model_dir, dtype, arithmetic.compute, freeze, accelerator.device, accelerator.num_processes
        )
        return model, report, arithmetic
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    report = apply_freeze(model, *freeze)
    keep_trainable_float32(model)
    return model, report, arithmetic_for(model, dtype, accelerator.device)


def _setup(
    recipe: MoFERecipe | TuningRecipe,
    model_dir: Path,
    accelerator: Accelerator,
    console: Console,
    dtype: torch.dtype,
    sharded: bool = False,
) -> _Run:
    """Load the MoE in ``dtype``, apply the freeze spec (trainable weights float32), tokenize the training data,
    make the optimizer and schedule."""
    from accelerate.utils import set_seed
    from transformers import AutoTokenizer

    spec: TrainSpec = recipe.train
    set_seed(spec.seed)
    model, report, arithmetic = _load(recipe, model_dir, accelerator, dtype, sharded)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    label = dtype_name(dtype)
    console.print(f"training in {arithmetic.describe()} on {accelerator.device}; the tuned model is written in {label}")
    console.print(
        f"parameters: [bold]{report.trainable_params:,}[/] trainable, {report.frozen_params:,} frozen "
        f"({len(report.trainable)} trainable tensors; preset {recipe.freeze.preset})"
    )
    if accelerator.num_processes > 1:
        layout = "FSDP2, each holding 1/" + str(accelerator.num_processes) + " of every weight" if sharded else None
        console.print(
            f"processes: {accelerator.num_processes} ({layout or accelerator.distributed_type.value}), "
            f"{spec.grad_accum // accelerator.num_processes} of the {spec.grad_accum} micro-batches of a step each"
        )
    streams = []
    for name, src in spec.data.items():
        train_text, _ = load_source(
            name, src, base_dir=recipe.recipe_dir, fraction=spec.validation_fraction, seed=spec.seed
        )
        streams.append(tokenize_stream(tok, train_text))
    opt = make_optimizer(model, spec)
    # no process count in it: a checkpoint resumes under any count
    key = [recipe.train.model_dump(), recipe.freeze.model_dump(), model_content_key(model_dir), label]
    fingerprint = json.dumps(key)
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
        micro=local_micro_batches(spec.grad_accum, accelerator.process_index, accelerator.num_processes),
        arithmetic=arithmetic,
        sharded=sharded,
    )


def _step(
    run: _Run, model: torch.nn.Module, opt: torch.optim.Optimizer, spec: TrainSpec, step: int, observe: bool
) -> torch.Tensor:
    """One optimizer step; this process runs its micro-batches of the step's ``grad_accum``.

    Returns this process's share of the step's figures, ``[5 + E]``: mean ce, lb, z (each summed here over its
    micro-batches ÷ ``grad_accum``), tokens it ran, then (when ``observe``) routing entropy and the ``E`` expert loads,
    means likewise. Summed over processes, they are the figures of the whole global batch.
    """
    acc = run.accelerator
    top_k = run.model.config.num_experts_per_tok
    n_experts = run.tap.routers[0].get_parameter("weight").shape[0]
    figures = torch.zeros(5 + n_experts, dtype=torch.float64)
    for micro in run.micro:
        # the micro-batch's index in the whole run picks its rows and its jitter: the same under any process count
        index = step * spec.grad_accum + micro
        batch = sample_batch(run.streams, spec.batch_size, spec.seq_len, seed=spec.seed, step=index, bos_id=run.bos).to(
            acc.device
        )
        run.tap.generator.manual_seed(spec.seed * 31 + index)
        run.tap.logits.clear()
        with acc.accumulate(model):
            with run.arithmetic.forward():
                out = model(input_ids=batch, labels=batch, use_cache=False)
                lb, z = routing_losses(run.tap.logits, top_k)
                loss = out.loss + spec.load_balancing_coef * lb + spec.z_loss_coef * z
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(run.params, spec.max_grad_norm)
            opt.step()
            opt.zero_grad()
        figures[:3] += torch.tensor([out.loss.item(), lb.item(), z.item()], dtype=torch.float64) / spec.grad_accum
        figures[3] += batch.numel()
        if observe:
            with torch.no_grad():
                figures[4] += float(torch.stack([routing_entropy(x) for x in run.tap.logits]).mean()) / spec.grad_accum
                load = torch.stack([expert_load(x, top_k) for x in run.tap.logits]).mean(0)
                figures[5:] += load.cpu().double() / spec.grad_accum
    run.sched.step()
    return figures


def _metrics(figures: torch.Tensor, spec: TrainSpec, done: int, lr: float, observe: bool) -> StepRecord:
    """A step's log record from its figures summed over processes (:func:`_step`)."""
    ce, lb, z = (float(x) for x in figures[:3])
    metrics: StepRecord = {
        "step": done,
        "loss": ce + spec.load_balancing_coef * lb + spec.z_loss_coef * z,
        "ce": ce,
        "lb": lb,
        "z": z,
        "lr": lr,
        "tokens": int(figures[3]),  # the global batch's: the processes' shares add up to it, none repeats another's
    }
    if observe:
        metrics["entropy"] = float(figures[4])
        metrics["load"] = figures[5:].tolist()
    return metrics


def _check_finite(run: _Run, spec: TrainSpec, metrics: StepRecord, done: int, ckpt: Path) -> None:
    """Stop on a non-finite loss or trainable weight: nothing is written, and the last good checkpoint stays.

    Raises:
        MoetoolError: naming the step, the loss, the learning rates and the way out.
    """
    from torch.distributed.tensor import DTensor

    trainable = (
        (n, p.to_local() if isinstance(p, DTensor) else p) for n, p in run.model.named_parameters() if p.requires_grad
    )
    bad = next((n for n, p in trainable if not bool(torch.isfinite(p).all())), None)
    # a sharded weight is checked slice by slice: every process learns whether any slice went bad, and all stop
    weights_bad = any_process(bad is not None, run.accelerator.device)
    if not weights_bad and math.isfinite(metrics["loss"]):
        return
    what = f"loss {metrics['loss']}" + (f", {bad or 'a trainable weight'} not finite" if weights_bad else "")
    if done == 1:
        why = "at the first step: check the model's weights (moetool inspect) and the learning rates"
    else:
        why = "lower train.learning_rate or train.router_learning_rate, or raise train.warmup_steps"
    kept = f"; the last good checkpoint ({ckpt}) is kept" if ckpt.exists() else ""
    raise MoetoolError(
        f"router tuning diverged at step {done} ({what}; learning_rate {spec.learning_rate}, router_learning_rate "
        f"{spec.router_learning_rate}): {why}. Nothing was written{kept}"
    )


def _loop(
    run: _Run,
    spec: TrainSpec,
    ckpt: Path,
    console: Console,
    callback: Callable[[int, StepRecord], None] | None,
) -> tuple[torch.nn.Module, float]:
    """Steps from ``run.start`` to ``spec.steps``: metrics every ``log_every``, checkpoints every ``checkpoint_every``."""
    acc = run.accelerator
    # a sharded model is FSDP's already; a whole one is wrapped for DDP (a no-op on one process)
    model, opt = (run.model, acc.prepare(run.opt)) if run.sharded else acc.prepare(run.model, run.opt)
    model.train()
    t0, tokens = time.perf_counter(), 0.0
    with task(console, "router tuning", spec.steps, unit="steps") as advance:
        advance(run.start)
        for step in range(run.start, spec.steps):
            done = step + 1
            observe = done % spec.log_every == 0 or done == spec.steps
            figures = reduce_sum(acc, _step(run, model, opt, spec, step, observe))
            tokens += float(figures[3])
            metrics = _metrics(figures, spec, done, float(run.sched.get_last_lr()[0]), observe)
            _check_finite(run, spec, metrics, done, ckpt)
            info = f"loss {metrics['loss']:.3f} ce {metrics['ce']:.3f} lb {metrics['lb']:.3f}"
            if observe:
                metrics["tokens_per_s"] = tokens / max(1e-9, time.perf_counter() - t0)
                run.history.append(metrics)
                load = " ".join(f"{x:.2f}" for x in metrics["load"])
                info += f" | {metrics['tokens_per_s']:.0f} tok/s | H {metrics['entropy']:.2f} | load {load}"
            advance(1, info)
            if done % spec.checkpoint_every == 0 and done < spec.steps:  # every process: shards are gathered
                args = (ckpt, done, acc.unwrap_model(model), run.opt, run.sched, run.history, run.fingerprint)
                save_checkpoint(*args, write=acc.is_main_process)
            if callback is not None:
                callback(done, metrics)
    return model, time.perf_counter() - t0


def train_router(
    recipe: MoFERecipe | TuningRecipe,
    model_dir: str | Path,
    output: str | Path,
    *,
    force: bool = False,
    resume: bool = True,
    console: Console | None = None,
    callback: Callable[[int, StepRecord], None] | None = None,
    preset: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
) -> TrainResult:
    """Tune an assembled MoE as the recipe's ``freeze:`` and ``train:`` sections say; write it to ``output``.

    Under a multi-process launch every process calls this; the main one prints, checkpoints and writes ``output``,
    and all return once it is written.

    Args:
        recipe: the validated recipe (:func:`moetool.recipe.load_recipe`) with ``freeze:`` and ``train:``.
        callback: called after every optimizer step with (step, metrics reduced over processes); raising from it
            interrupts the run (the last checkpoint remains, and the next call resumes from it, under any process
            count).
        preset: overrides the recipe's ``freeze.preset``.
        dtype: float32, bfloat16 or float16; default (or ``auto``): the checkpoint's own dtype, which the tuned
            model is written in too.
        device: auto (a GPU when there is one), cpu, cuda or cuda:N; under ``accelerate launch`` the launcher's.

    Raises:
        MoetoolError: bad model, data or freeze patterns; an existing output without ``force``; a process count
            that does not divide ``train.grad_accum``.
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
        raise MoetoolError(f"--model: {model_dir} is not a checkpoint directory (no config.json)")
    compute = resolve_dtype(dtype, model_dir)
    sharded = fsdp_requested()
    # before anything is loaded or written: a run that cannot fit says so now, not when it is killed
    tuning_need(model_dir, spec, recipe.freeze.preset, compute, output, launch_of(sharded)).check()
    asked = resolve_device(device) if device not in (None, "auto") else None
    acc = make_accelerator(spec.grad_accum, device=asked, sharded=sharded)
    console = console if acc.is_main_process else silent()
    if single_cpu_launch():
        console.print(
            "note: `accelerate launch --cpu` started this one process (without MPI it starts no more); for several "
            "CPU processes see examples/accelerate/README.md. One process gives the same result, only slower."
        )
    run = _setup(recipe, model_dir, acc, console, compute, sharded)
    ckpt = checkpoint_dir(output)
    if ckpt.exists() and resume:
        run.start, run.history = load_checkpoint(ckpt, run.model, run.opt, run.sched, run.fingerprint)
        console.print(f"resuming from step {run.start} ({ckpt})")
    acc.wait_for_everyone()  # every process has read the checkpoint before the main one may remove or replace it
    if ckpt.exists() and not resume and acc.is_main_process:
        shutil.rmtree(ckpt)
    prepared_model, seconds = _loop(run, spec, ckpt, console, callback)
    run.tap.remove()
    run.arithmetic.remove()
    acc.wait_for_everyone()
    result = TrainResult(output, spec.steps, run.report, run.history, seconds, run.start, acc.is_main_process)
    model = acc.unwrap_model(prepared_model)
    # every process gathers (shards come from all); the main one keeps the float32 masters in the input's dtype
    tuned = tuned_tensors(model, compute, keep=acc.is_main_process)
    processes = process_record(acc, sharded)
    if acc.is_main_process:
        args = (tuned, model.config, model_dir, output, recipe, run.report, run.history, seconds, force)
        write_output(*args, dtype=compute, processes=processes)
        shutil.rmtree(ckpt, ignore_errors=True)
    acc.wait_for_everyone()  # the others return once the output exists
    return result
