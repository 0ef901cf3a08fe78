"""The default ExecuTorch export: one program that ExecuTorch's own LLM runner (``TextLLMRunner``) loads unchanged,
``model.pte`` with its weights in ``model.ptd`` and the model's tokenizer beside them.

The float model is never held: a child process (:func:`moetool.export.executorch.lowering.lower_runner`) reads the
decoder layers one at a time from the checkpoint, rounds each per the plan and drops its float weights, then
exports and lowers the whole :class:`~moetool.export.executorch.runner_model.RunnerLM` once. The check runs the
program in ``executorch.runtime`` over the parity calls (the cache inside the program, positions given) against
transformers, then has the runner itself generate greedily (:mod:`moetool.export.executorch.runner_check`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moetool.export.base import NOT_VERIFIED, ExportError, ExportRequest
from moetool.export.executorch.lowering import Bounds, bounds_for
from moetool.export.graph.moe_kernel import dense_moe_kernel
from moetool.export.greedy import stop_ids
from moetool.export.parity import ParityRecord
from moetool.export.pipeline_steps import finish_graph_manifest, is_float_plan, reference_parity
from moetool.io.atomic import atomic_dir
from moetool.io.jsontypes import JsonObject
from moetool.progress import step_printer

if TYPE_CHECKING:
    from rich.console import Console

    from moetool.export.graph.common import GraphPlan
    from moetool.export.graph.parity import Batch, Call

__all__ = ["TOKENIZER_FILES", "export_runner_program", "runner_batch"]

# what the runner's tokenizer loader reads from the folder (tokenizer.json, with tokenizer_config.json's bos/eos)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def runner_batch(pte: Path, ptd: Path) -> Batch:
    """Every parity call through the program's ``forward`` in ``executorch.runtime``, as the runner calls it:
    ``tokens`` [1, T] and the first position; a prefill starts at 0 (what it left in the cache is masked)."""

    def run_all(calls: list[Call]) -> list[np.ndarray]:
        from executorch.runtime import Runtime

        forward = Runtime.get().load_program(str(pte), data_path=str(ptd)).load_method("forward")
        out = []
        for ids, pos in calls:
            logits = forward.execute([torch.from_numpy(ids).long(), torch.tensor([pos or 0])])[0]
            out.append(logits.numpy().copy())
        return out

    return run_all


def _lowered(req: ExportRequest, plan: GraphPlan, out: Path, bounds: Bounds, meta: dict[str, Any]) -> dict[str, Any]:
    from moetool.export.worker import run_worker

    request: dict[str, Any] = {"model_dir": str(req.model_dir), "precisions": plan.precisions(), "out_dir": str(out)}
    request |= {"prefill": bounds.prefill, "context": bounds.context, "runner": meta}
    return run_worker("moetool.export.executorch.lowering", request, what="ExecuTorch lowering")


def export_runner_program(req: ExportRequest, plan: GraphPlan, console: Console | None = None) -> JsonObject:
    """Write the runner program of ``plan``'s model into ``req.output`` atomically, check it unless ``req.verify`` is
    off, and return the manifest.

    Raises:
        ExportError: the model has no ``tokenizer.json`` (before anything is done), the lowering failed, or a float
            plan's program misses the parity gate or generates other tokens than transformers in the runner.
    """
    from transformers import AutoTokenizer

    from moetool.export.executorch.runner_model import runner_metadata

    if not (req.model_dir / "tokenizer.json").is_file():  # before minutes of lowering
        raise ExportError(f"{req.model_dir}: no tokenizer.json, which ExecuTorch's runner reads")
    started = time.perf_counter()
    step = step_printer(console, started)
    cfg = plan.config
    bounds = bounds_for(plan.context, int(cfg.get("max_position_embeddings", plan.context)))
    bos = AutoTokenizer.from_pretrained(str(req.model_dir)).bos_token_id
    eos = stop_ids(req.model_dir)
    n_layers = int(cfg["num_hidden_layers"])
    meta = runner_metadata(
        max_seq_len=bounds.prefill,
        context=bounds.context,
        vocab=int(cfg["vocab_size"]),
        bos=bos,
        eos=eos,
        layers=n_layers,
    )
    with atomic_dir(req.output, force=req.force) as tmp:
        step("reading and rounding the layers one at a time, torch.export and XNNPACK lowering, in a child process")
        result = _lowered(req, plan, tmp, bounds, meta)
        pte, ptd = tmp / "model.pte", tmp / "model.ptd"
        for name in TOKENIZER_FILES:
            if (req.model_dir / name).is_file():
                shutil.copy2(req.model_dir / name, tmp / name)
        parity: ParityRecord | str = NOT_VERIFIED
        runner: JsonObject | str = NOT_VERIFIED
        if req.verify:
            step("checking the program in executorch.runtime against transformers")
            parity, runner = _verify(req, plan, pte, ptd, set(eos))
            step(
                f"ExecuTorch's runner: {runner['same_leading_tokens']} of {runner['new_tokens']} greedy tokens as transformers'"
            )
        fields: JsonObject = {
            "runtime": "executorch.runtime and ExecuTorch's TextLLMRunner, XNNPACK delegate",
            "export": "streamed: the decoder layers read from the checkpoint and rounded one at a time (the float model "
            "never held), then lowered as one program in a process of its own; the weights in model.ptd",
            "methods": {
                "forward": f"tokens [1, 1 to {bounds.prefill}] and the first position [1] → logits [1, T, V]; the KV "
                f"cache inside the program ({bounds.context} positions)",
            },
            "metadata": dict(meta),
            "bounds": {"prefill": bounds.prefill, "context": bounds.context},
            "programs": [{"file": "model.pte", "data": "model.ptd", "layers": [0, n_layers]}],
            "run_with": "TextLLMRunner('model.pte', 'tokenizer.json', 'model.ptd'), or the C++ llama runner / demo "
            "apps with --model_path model.pte --data_path model.ptd --tokenizer_path tokenizer.json",
            "quantized_linears": {**result["quantized_linears"]},
            "moe_kernel": dense_moe_kernel("executorch", int(result["moe_layers"])),
            "runner": runner,
        }
        files = {p.name: p for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = finish_graph_manifest(
            tmp, "executorch", plan, files, "model.pte", fields, parity=parity, started=started, notes=result["notes"]
        )
    return manifest


def _verify(
    req: ExportRequest, plan: GraphPlan, pte: Path, ptd: Path, stops: set[int]
) -> tuple[ParityRecord, JsonObject]:
    """Parity of the program in ``executorch.runtime`` and its greedy generation in the runner, both against
    transformers (held in float32 for a small model, else streamed from disk).

    Raises:
        ExportError: a float plan misses the parity gate, or its runner's tokens are not transformers'.
    """
    from moetool.export.executorch.runner_check import runner_check
    from moetool.export.reference import graph_reference

    ref = graph_reference(req.model_dir, plan.quant.total_params, plan.config)
    float_plan = is_float_plan(plan)
    gate_as = "ExecuTorch (fp32)" if float_plan else None
    parity = reference_parity(req, ref, runner_batch(pte, ptd), runtime="executorch (XNNPACK)", gate_as=gate_as)
    runner = runner_check(pte, ptd, pte.parent, ref.model, stops)
    if float_plan and not runner["tokens_equal"]:
        raise ExportError(
            f"ExecuTorch's runner generated {runner['text']!r} where transformers generates "
            f"{runner['reference_text']!r} (the same first {runner['same_leading_tokens']} tokens) at fp32"
        )
    return parity, runner
