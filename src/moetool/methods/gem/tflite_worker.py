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

import numpy as np
import torch

from moetool.io.jsontypes import JsonObject


def convert(req: JsonObject) -> JsonObject:
    """The request (module docstring) in, gem.tflite written, the result out."""
    import litert_torch
    from ai_edge_litert.interpreter import Interpreter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moetool.export.graph.model import causal_mask
    from moetool.export.tflite.runner import padded_feeds, signature_outputs
    from moetool.methods.gem.export_graph import GemGraph
    from moetool.methods.gem.export_parity import probe_windows, route_parity
    from moetool.methods.gem.model import GemForCausalLM  # registers its model class

    model_dir, out_dir, cap = req["model_dir"], req["out_dir"], req["capacity"]
    if not (isinstance(model_dir, str) and isinstance(out_dir, str) and isinstance(cap, int)):
        raise TypeError(f"a gem TFLite request needs model_dir, out_dir (strings) and capacity (int): {req}")
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if not isinstance(model, GemForCausalLM):
        raise TypeError(f"{model_dir}: not a moetool_gem checkpoint")
    graph = GemGraph(model).eval()
    mask = causal_mask(cap, 0)
    path = Path(out_dir) / "gem.tflite"
    litert_torch.convert(graph, (torch.zeros(1, cap, dtype=torch.long), torch.arange(cap)[None], mask)).export(
        str(path)
    )
    result: JsonObject = {"capacity": cap}
    if req["verify"]:
        runner = Interpreter(model_path=str(path)).get_signature_runner()

        def run(ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            n = len(ids)
            logits, probs, routes = signature_outputs(runner, padded_feeds(ids, cap, mask.numpy()))
            return logits[:, :n], probs[:, :n], routes[:, :n]

        tok = AutoTokenizer.from_pretrained(model_dir)
        probes = probe_windows(tok, Path(model_dir), (32, cap))
        result["parity"] = route_parity(model, probes, run, runtime="ai_edge_litert interpreter").to_json()
    return result


if __name__ == "__main__":
    from moetool.export.tflite.runner import worker_main

    worker_main(convert)
