"""The router-tuning recipe shared by the one-process and multi-process training tests: three tiny llama experts
with random gates, two domains of synthetic text, checkpoints every 2 steps."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import TEXT, write_recipe


def write_tuning_recipe(d: Path, models: dict[str, Path], steps: int, legal_jsonl: bool = False) -> Path:
    """Write the corpora and ``r.yaml`` into ``d``; ``legal_jsonl`` feeds the legal text as JSONL, else plain text."""
    (d / "code.txt").write_text("\n\n".join(f"def f{i}(x):\n    return x + {i}\nimport os" for i in range(200)))
    legal = [TEXT.split("\n")[1] + f" clause {i}" for i in range(200)]
    if legal_jsonl:
        (d / "legal.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in legal))
        legal_source = "{jsonl: legal.jsonl}"
    else:
        (d / "legal.txt").write_text("\n\n".join(legal))
        legal_source = "{text: legal.txt}"
    return write_recipe(
        d / "r.yaml",
        f"""
name: tune
method: mofe
base_model: {models["base"]}
gate_mode: random
experts:
  - {{name: a, source: {models["e1"]}}}
  - {{name: b, source: {models["e2"]}}}
  - {{name: c, source: {models["e3"]}}}
freeze:
  preset: mofe
train:
  data:
    code: {{text: code.txt}}
    legal: {legal_source}
  steps: {steps}
  batch_size: 2
  seq_len: 16
  grad_accum: 2
  learning_rate: 0.01
  checkpoint_every: 2
  log_every: 2
  router_jitter: 0.1
""",
    )


def read_all_tensors(path: Path) -> dict[str, object]:
    """Every tensor of a model folder's safetensors files, by name."""
    from safetensors import safe_open

    out: dict[str, object] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118  (a safetensors handle, not a dict)
    return out
