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

import numpy as np
import torch

from moetool.io.jsontypes import JsonObject


def convert(req: JsonObject) -> JsonObject:
    """The request (module docstring) in, model.tflite written, the result out."""
    import litert_torch
    from ai_edge_litert.interpreter import Interpreter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moetool.methods.embedding.model  # noqa: F401  (registers its model class)
    from moetool.export.heldout import agreement, windows
    from moetool.export.parity import ParityRecord
    from moetool.export.tflite.runner import padded_feeds, signature_outputs
    from moetool.methods.embedding.export import ExportRoutedLM, PrefillLogits
    from moetool.methods.embedding.router import causal_mask

    model_dir, out_dir, plen, text = req["model_dir"], req["out_dir"], req["prefill_len"], req["eval_text"]
    if not (
        isinstance(model_dir, str) and isinstance(out_dir, str) and isinstance(plen, int) and isinstance(text, str)
    ):
        raise TypeError(f"a TFLite request needs model_dir, out_dir, eval_text (strings) and prefill_len (int): {req}")
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    wrapper = PrefillLogits(ExportRoutedLM(hf)).eval()
    args = (torch.zeros(1, plen, dtype=torch.long), torch.arange(plen)[None], causal_mask(plen, 0))
    edge = litert_torch.signature("prefill", wrapper, args).convert()
    path = Path(out_dir) / "model.tflite"
    edge.export(str(path))
    runner = Interpreter(model_path=str(path)).get_signature_runner("prefill")
    mask = causal_mask(plen, 0).numpy()

    def prefill(ids: list[int]) -> np.ndarray:
        """Logits ``[len(ids), V]`` of the right-padded prefill."""
        return np.asarray(signature_outputs(runner, padded_feeds(ids, plen, mask))[0])[0, : len(ids)]

    tok = AutoTokenizer.from_pretrained(model_dir)
    probes, ppl_windows = windows(tok, text, [32, plen], 4)
    vs = agreement([prefill(ids) for ids in probes + ppl_windows], hf, probes, ppl_windows)
    parity = ParityRecord(runtime="ai_edge_litert interpreter", reference="transformers float32", seq_lens=(32, plen))
    return {"parity": parity.with_figures(vs).to_json(), "prefill_len": plen, "signatures": ["prefill"]}


if __name__ == "__main__":
    from moetool.export.tflite.runner import worker_main

    worker_main(convert)
