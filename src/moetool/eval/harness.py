"""lm-evaluation-harness tasks for every model side by side, through lm-eval's Python API and its ``hf`` model class.

Task names are lm-eval's own (``hellaswag``, ``arc_easy`` …: they run when their datasets are in the local Hugging
Face cache) or moetool's local tasks (:mod:`moetool.eval.tasks`), built from the zoo's held-out text.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from moetool.errors import MoetoolError
from moetool.extras import require
from moetool.io.jsontypes import JsonObject

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# what each task reports, in order; the "_stderr" of each is kept beside it
METRICS = ("acc", "acc_norm", "exact_match", "f1", "mcc")


class TaskError(MoetoolError):
    """An lm-eval task cannot run (unknown name, dataset not in the local cache)."""


@contextmanager
def _quiet_offline() -> Iterator[None]:
    """No Hub access (datasets come from the local cache) and lm-eval's per-request INFO lines silenced."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    # lm-eval warns that a model object (not a path) was passed: that is how moetool loads every model
    levels = {n: logging.getLogger(n).level for n in ("lm-eval", "lm_eval", "datasets")}
    for n in levels:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for n, lvl in levels.items():
            logging.getLogger(n).setLevel(lvl)


def _scores(results: Mapping[str, object]) -> dict[str, float]:
    """``{"acc": 0.5, "acc_stderr": 0.1, …}`` from one task's lm-eval results (keys like ``acc,none``)."""
    out: dict[str, float] = {}
    for key, value in results.items():
        metric, _, _filter = key.partition(",")
        base = metric.removesuffix("_stderr")
        if base in METRICS and isinstance(value, int | float):
            out[metric] = float(value)
    return out


def task_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str | JsonObject],
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Run lm-eval ``tasks`` (names or task-config dicts) on one loaded model.

    Returns:
        task name → ``{metric: value, metric_stderr: value}`` (``acc``, ``acc_norm``, … whichever the task reports),
        plus ``n`` (documents scored).

    Raises:
        TaskError: an unknown task, or one whose dataset is not in the local cache.
    """
    lm_eval = require("lm_eval", "eval", why="lm-evaluation-harness tasks")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    names = [t if isinstance(t, str) else str(t["task"]) for t in tasks]
    with _quiet_offline():
        # the loaded model's own device and dtype (the evaluation's), not a fixed float32 CPU
        from moetool.compute.dtypes import dtype_name

        dtype = dtype_name(model.dtype)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device), dtype=dtype)
        try:
            res = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(tasks),
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=TaskManager(),
                log_samples=False,
                bootstrap_iters=1000,
                random_seed=seed,
                fewshot_random_seed=seed,
            )
        except (KeyError, ValueError, FileNotFoundError, ConnectionError) as e:
            raise TaskError(f"lm-eval could not run {', '.join(names)}: {e}") from e
    if res is None:
        raise TaskError("lm-eval returned no results (not the main process?)")
    out = {}
    for name in names:
        if name not in res["results"]:
            raise TaskError(f"lm-eval gave no result for task {name!r}")
        out[name] = _scores(res["results"][name]) | {
            "n": float(res.get("n-samples", {}).get(name, {}).get("effective", 0))
        }
    return out
