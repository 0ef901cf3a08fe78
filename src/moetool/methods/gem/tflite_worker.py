"""TFLite conversion of the token-level GEM graph, run where litert-torch is installed (``.venv-litert``, through
:mod:`moetool.export.tflite.runner`).

    python -m moetool.methods.gem.tflite_worker REQUEST.json

REQUEST: model_dir, out_dir (existing, empty), capacity (the graph's static length), verify. Writes gem.tflite and
prints the result JSON on the last line. TFLite graphs have static shapes, so the graph takes exactly ``capacity``
tokens; shorter inputs are right-padded, which changes nothing before the padding (causal attention, causal router
features, per-token SCAR clusters). Parity: the LiteRT interpreter against PyTorch at lengths 32 and ``capacity``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def convert(req: dict[str, Any]) -> dict[str, Any]:
    """The request (module docstring) in, gem.tflite written, the result out."""
    import litert_torch
    from ai_edge_litert.interpreter import Interpreter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moetool.methods.gem.model  # noqa: F401  (registers its model class)
    from moetool.export.graph.model import causal_mask
    from moetool.export.tflite.runner import padded_feeds, signature_outputs
    from moetool.methods.gem.export_graph import GemGraph
    from moetool.methods.gem.export_parity import probe_windows, route_parity

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=torch.float32).eval()
    graph = GemGraph(model).eval()
    cap = int(req["capacity"])
    mask = causal_mask(cap, 0)
    path = Path(req["out_dir"]) / "gem.tflite"
    litert_torch.convert(graph, (torch.zeros(1, cap, dtype=torch.long), torch.arange(cap)[None], mask)).export(
        str(path)
    )
    result: dict[str, Any] = {"capacity": cap}
    if req["verify"]:
        runner = Interpreter(model_path=str(path)).get_signature_runner()

        def run(ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            n = len(ids)
            logits, probs, routes = signature_outputs(runner, padded_feeds(ids, cap, mask.numpy()))
            return logits[:, :n], probs[:, :n], routes[:, :n]

        tok = AutoTokenizer.from_pretrained(req["model_dir"])
        probes = probe_windows(tok, Path(req["model_dir"]), (32, cap))
        result["parity"] = route_parity(model, probes, run, runtime="ai_edge_litert interpreter")
    return result


if __name__ == "__main__":
    from moetool.export.tflite.runner import worker_main

    worker_main(convert)
