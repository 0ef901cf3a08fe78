"""TFLite conversion of the token-level GEM graph, run where litert-torch is installed (``.venv-litert``).

    python -m moetool.methods.gem.tflite_worker REQUEST.json

REQUEST: model_dir, out_dir (existing, empty), capacity (the graph's static length), verify. Writes gem.tflite and
prints the result JSON on the last line. TFLite graphs have static shapes, so the graph takes exactly ``capacity``
tokens; shorter inputs are right-padded, which changes nothing before the padding (causal attention, causal router
features, per-token SCAR clusters). Parity: the LiteRT interpreter against PyTorch at lengths 32 and ``capacity``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch


def main(request_path: str) -> None:
    import litert_torch
    from ai_edge_litert.interpreter import Interpreter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moetool.methods.gem  # noqa: F401  (registers moetool_gem)
    from moetool.export.graph.model import causal_mask
    from moetool.methods.gem.export import GemGraph, _probe_windows

    req: dict[str, Any] = json.loads(Path(request_path).read_text())
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=torch.float32).eval()
    graph = GemGraph(model).eval()
    cap = int(req["capacity"])
    args = (torch.zeros(1, cap, dtype=torch.long), torch.arange(cap)[None], causal_mask(cap, 0))
    path = Path(req["out_dir"]) / "gem.tflite"
    litert_torch.convert(graph, args).export(str(path))
    result: dict[str, Any] = {"capacity": cap}
    if req["verify"]:
        runner = Interpreter(model_path=str(path)).get_signature_runner()
        tok = AutoTokenizer.from_pretrained(req["model_dir"])
        probes = _probe_windows(tok, Path(req["model_dir"]), (32, cap))
        worst_logit = worst_p = 0.0
        mism = mism_off = tokens = 0
        tau = float(model.config.tau)
        for ids in probes:
            n = len(ids)
            padded = np.zeros((1, cap), dtype=np.int32)
            padded[0, :n] = ids
            out = runner(args_0=padded, args_1=np.arange(cap, dtype=np.int32)[None], args_2=causal_mask(cap, 0).numpy())
            logits, probs, routes = (out[k] for k in sorted(out, key=lambda k: int(k.split("_")[-1])))
            with torch.no_grad():
                ref = model(torch.tensor([ids]))
            worst_logit = max(worst_logit, float(np.abs(logits[:, :n] - ref.logits.numpy()).max()))
            worst_p = max(worst_p, float(np.abs(probs[:, :n] - ref.router_probs.numpy()).max()))
            diff = routes[:, :n] != ref.routes.numpy()
            near = np.abs(ref.router_probs.numpy().max(-1) - tau) < 1e-5
            mism += int(diff.sum())
            mism_off += int((diff & ~near).sum())
            tokens += n
        result["parity"] = {
            "runtime": "ai_edge_litert interpreter",
            "reference": "PyTorch moetool_gem float32",
            "seq_lens": sorted({len(p) for p in probes}),
            "windows": len(probes),
            "tokens": tokens,
            "max_abs_logit_diff": worst_logit,
            "max_abs_prob_diff": worst_p,
            "route_mismatches": mism,
            "route_mismatches_off_boundary": mism_off,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
