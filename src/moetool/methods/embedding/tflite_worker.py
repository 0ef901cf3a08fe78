"""TFLite conversion of a routed-embedding model's prefill, run where litert-torch is installed (``.venv-litert``,
through :mod:`moetool.export.tflite.runner`).

    python -m moetool.methods.embedding.tflite_worker REQUEST.json

REQUEST has model_dir, out_dir (existing, empty), prefill_len, eval_text. One ``prefill`` signature over
``prefill_len`` right-padded tokens (causal, so padding after position n leaves positions < n exact). Writes
model.tflite and prints the result JSON on the last line: parity in the LiteRT interpreter against transformers at
two lengths, and top-1 agreement and perplexity on held-out windows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def convert(req: dict[str, Any]) -> dict[str, Any]:
    """The request (module docstring) in, model.tflite written, the result out."""
    import litert_torch
    from ai_edge_litert.interpreter import Interpreter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moetool.methods.embedding.model  # noqa: F401  (registers its model class)
    from moetool.export.heldout import agreement, windows
    from moetool.export.tflite.runner import padded_feeds, signature_outputs
    from moetool.methods.embedding.export import ExportRoutedLM, PrefillLogits
    from moetool.methods.embedding.router import causal_mask

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=torch.float32).eval()
    plen = int(req["prefill_len"])
    wrapper = PrefillLogits(ExportRoutedLM(hf)).eval()
    args = (torch.zeros(1, plen, dtype=torch.long), torch.arange(plen)[None], causal_mask(plen, 0))
    edge = litert_torch.signature("prefill", wrapper, args).convert()
    path = Path(req["out_dir"]) / "model.tflite"
    edge.export(str(path))
    runner = Interpreter(model_path=str(path)).get_signature_runner("prefill")
    mask = causal_mask(plen, 0).numpy()

    def prefill(ids: list[int]) -> np.ndarray:
        """Logits ``[len(ids), V]`` of the right-padded prefill."""
        return np.asarray(signature_outputs(runner, padded_feeds(ids, plen, mask))[0])[0, : len(ids)]

    tok = AutoTokenizer.from_pretrained(req["model_dir"])
    probes, ppl_windows = windows(tok, req["eval_text"], [32, plen], 4)
    vs = agreement([prefill(ids) for ids in probes + ppl_windows], hf, probes, ppl_windows)
    parity = {
        "runtime": "ai_edge_litert interpreter",
        "reference": "transformers float32",
        "seq_lens": [32, plen],
        "max_abs_logit_diff": vs.max_abs_logit_diff,
    } | vs.to_json()
    return {"parity": parity, "prefill_len": plen, "signatures": ["prefill"]}


if __name__ == "__main__":
    from moetool.export.tflite.runner import worker_main

    worker_main(convert)
