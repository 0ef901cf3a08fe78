"""Run a moetool Core ML export on a Mac and compare it with transformers (Core ML cannot predict on Linux).

    python scripts/coreml_parity_mac.py EXPORT_DIR MODEL_DIR [--text FILE]

EXPORT_DIR is `moetool export --target coreml` output (model.mlpackage + manifest.json, or the chunks its manifest
lists, run in sequence), MODEL_DIR the model it was exported from. Needs macOS 15+ with coremltools, torch and transformers. Prints max |Δlogit| for a prefill at two
lengths and for 8 cached decode steps, top-1 agreement, and exits 1 if fp16 drift exceeds --tol (default 0.1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def causal_mask(t: int, past: int) -> np.ndarray:
    m = np.triu(np.full((t, past + t), -1e4, dtype=np.float16), k=past + 1)  # fp16-safe "minus infinity"
    return m[None, None]


class Chain:
    """The export's packages as one model: the manifest's ``chunks`` run in order, each chunk's output hidden states
    the next one's input, each with its own state (one package: itself)."""

    def __init__(self, export_dir: str) -> None:
        import json

        import coremltools as ct

        chunks = json.loads(Path(export_dir, "manifest.json").read_text()).get("chunks") or [
            {"file": "model.mlpackage"}
        ]
        self.models = [ct.models.MLModel(str(Path(export_dir, c["file"]))) for c in chunks]

    def make_state(self) -> list:
        return [m.make_state() for m in self.models]

    def predict(self, inputs: dict, state: list) -> dict:
        x = {"input_ids": inputs["input_ids"]}
        out: dict = {}
        for m, s in zip(self.models, state, strict=True):
            out = m.predict({**x, "position_ids": inputs["position_ids"], "mask": inputs["mask"]}, s)
            if "next_hidden_states" in out:
                x = {"hidden_states": out["next_hidden_states"]}
        return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("model_dir")
    ap.add_argument("--text", default=None)
    ap.add_argument("--tol", type=float, default=0.1)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ml = Chain(args.export_dir)
    hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    text = Path(args.text).read_text() if args.text else "def main():\n    return 42\n" * 40
    ids = tok(text).input_ids[:128]
    worst = 0.0
    agree = total = 0
    for n in (32, len(ids)):
        state = ml.make_state()
        out = ml.predict(
            {
                "input_ids": np.array([ids[:n]], np.int32),
                "position_ids": np.arange(n, dtype=np.int32)[None],
                "mask": causal_mask(n, 0),
            },
            state,
        )["logits"][0]
        with torch.no_grad():
            ref = hf(torch.tensor([ids[:n]])).logits[0].numpy()
        d = float(np.abs(out - ref).max())
        agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
        total += n
        worst = max(worst, d)
        print(f"prefill {n}: max |Δlogit| {d:.3e}")
    state = ml.make_state()
    n0 = len(ids) - 8
    ml.predict(
        {
            "input_ids": np.array([ids[:n0]], np.int32),
            "position_ids": np.arange(n0, dtype=np.int32)[None],
            "mask": causal_mask(n0, 0),
        },
        state,
    )
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    for t in range(n0, len(ids)):
        out = ml.predict(
            {
                "input_ids": np.array([[ids[t]]], np.int32),
                "position_ids": np.array([[t]], np.int32),
                "mask": causal_mask(1, t),
            },
            state,
        )["logits"][0, -1]
        worst = max(worst, float(np.abs(out - ref[t]).max()))
    print(f"decode 8 steps with states: max |Δlogit| so far {worst:.3e}; top-1 agreement {agree / total:.4f}")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
