"""Run a moetool Core ML export on a Mac and compare it with transformers (Core ML cannot predict on Linux).

    python scripts/coreml_parity_mac.py EXPORT_DIR MODEL_DIR [--text FILE]

EXPORT_DIR is `moetool export --target coreml` output (one model.mlpackage + manifest.json, however many chunks it
was converted and joined from), MODEL_DIR the model it was exported from. Needs macOS 15+ with coremltools, torch and
transformers. The package is fed as an app feeds it: `inputIds` and `causalMask` (whose last axis gives the positions)
with one state from `make_state()` per sequence (`keyCache`/`valueCache`), a prefill and then cached decode steps.
Prints max |Δlogit| for a prefill at two lengths and for 8 cached decode steps, top-1 agreement, and exits 1 if fp16
drift exceeds --tol (default 0.1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

INPUTS = ["inputIds", "causalMask"]
STATES = ["keyCache", "valueCache"]


def causal_mask(t: int, past: int) -> np.ndarray:
    m = np.triu(np.full((t, past + t), -1e4, dtype=np.float16), k=past + 1)  # fp16-safe "minus infinity"
    return m[None, None]


def load(export_dir: str):  # a coremltools MLModel
    """The export's one package, after checking that it declares the names the feed below uses."""
    import json

    import coremltools as ct

    manifest = json.loads(Path(export_dir, "manifest.json").read_text())
    structure = manifest.get("structure") or {}
    if structure and (structure.get("inputs") != INPUTS or structure.get("states") != STATES):
        raise SystemExit(f"{export_dir}: expected inputs {INPUTS} and states {STATES}, the manifest says {structure}")
    return ct.models.MLModel(str(Path(export_dir, manifest.get("file", "model.mlpackage"))))


def step(ml, ids: list[int], past: int, state) -> np.ndarray:  # ml: an MLModel, state: its MLState
    """Logits [T, V] of ``ids`` after ``past`` positions already in ``state``."""
    feed = {"inputIds": np.array([ids], np.int32), "causalMask": causal_mask(len(ids), past)}
    return np.asarray(ml.predict(feed, state)["logits"])[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("model_dir")
    ap.add_argument("--text", default=None)
    ap.add_argument("--tol", type=float, default=0.1)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ml = load(args.export_dir)
    hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    text = Path(args.text).read_text() if args.text else "def main():\n    return 42\n" * 40
    ids = tok(text).input_ids[:128]
    worst = 0.0
    agree = total = 0
    for n in (32, len(ids)):
        out = step(ml, ids[:n], 0, ml.make_state())  # a new sequence: a new state
        with torch.no_grad():
            ref = hf(torch.tensor([ids[:n]])).logits[0].numpy()
        d = float(np.abs(out - ref).max())
        agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
        total += n
        worst = max(worst, d)
        print(f"prefill {n}: max |Δlogit| {d:.3e}")
    state = ml.make_state()
    n0 = len(ids) - 8
    step(ml, ids[:n0], 0, state)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    for t in range(n0, len(ids)):
        out = step(ml, [ids[t]], t, state)[-1]  # one token; the state holds the t before it
        worst = max(worst, float(np.abs(out - ref[t]).max()))
    print(f"decode 8 steps with states: max |Δlogit| so far {worst:.3e}; top-1 agreement {agree / total:.4f}")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
