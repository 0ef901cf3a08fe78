"""The LiteRT worker protocol, both sides: every TFLite conversion (the standard exporter's, GEM's token graph, the
routed embedding's prefill) runs as ``python -m WORKER REQUEST.json`` in the interpreter that has litert-torch.

litert-torch pins typing-extensions and pydantic below what onnx/executorch tooling here needs, so it lives in its
own venv (``bash scripts/setup.sh --tflite`` makes ``.venv-litert``); if litert-torch is importable in the current
interpreter that one is used instead.

- Caller: :func:`run_worker` writes the request (a JSON object), runs the worker module and returns the JSON object
  the worker printed on its last stdout line; a failed worker is an :class:`ExportError` with its stderr's tail.
- Worker: :func:`worker_main` is its ``__main__`` (request in, result printed); :func:`padded_feeds` and
  :func:`signature_outputs` are how a signature runner of the LiteRT interpreter is fed and read.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moetool.export import worker
from moetool.export.worker import worker_main
from moetool.extras import missing

__all__ = ["REPO", "litert_python", "padded_feeds", "run_worker", "signature_outputs", "worker_main"]

REPO = Path(__file__).resolve().parents[4]


def litert_python() -> str:
    """The interpreter that has litert-torch: ``MOETOOL_LITERT_PYTHON``, this one, or the repository's
    ``.venv-litert``.

    Raises:
        MissingExtraError: none has it, saying how to make one.
    """
    env = os.environ.get("MOETOOL_LITERT_PYTHON")
    if env:
        return env
    if importlib.util.find_spec("litert_torch") is not None:
        return sys.executable
    venv = REPO / ".venv-litert" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    raise missing("litert-torch", "tflite", why="TFLite export")


def run_worker(
    module: str, request: dict[str, Any], *, what: str = "TFLite conversion", env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run worker ``module`` on ``request`` in :func:`litert_python` (:func:`moetool.export.worker.run_worker`), with
    ``env`` added to the environment.

    Raises:
        ExportError: ``"{what} failed in {python}:"`` and the last lines of the worker's stderr.
    """
    return worker.run_worker(module, request, python=litert_python(), what=what, env=env)


def padded_feeds(ids: Sequence[int], length: int, mask: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs of a static-length prefill signature: ``args_0`` ids right-padded to ``length`` ``[1, length]``
    int32, ``args_1`` positions ``[1, length]`` int32, ``args_2`` ``mask``. Causal graphs leave the outputs before
    the padding exact."""
    padded = np.zeros((1, length), dtype=np.int32)
    padded[0, : len(ids)] = np.asarray(ids)
    return {"args_0": padded, "args_1": np.arange(length, dtype=np.int32)[None], "args_2": mask}


def signature_outputs(runner: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a LiteRT signature runner; its outputs in output order (``output_0``, ``output_1``, … sorted by number,
    not by name: ``output_10`` comes after ``output_9``)."""
    out = runner(**feeds)
    return [out[k] for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
