"""The packaged card's consumer matrix: where the shared folder computes what transformers computes, and how that
was checked — so a user sees before downloading that it loads in mlx-lm and llama.cpp.

mlx-lm is run on the folder where it is installed (logits at two lengths against transformers float32); llama.cpp
is judged by the packaged GGUF artifacts' own parity and by what its converter does with this config
(``arch.records.consumer_caveats``); vLLM by the rules read from its source (it needs a GPU).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetool.arch.consumers import MLX_LM, VLLM
from moetool.arch.records import converter_caveat, model_record, rope_caveat
from moetool.export.parity import ParityRecord
from moetool.package.inputs import Artifact

# float32 on both sides, summed in another order: the MLX target's f32 gate (the real SmolLM2 MoE: 1.75e-4)
TOLERANCE = 1e-3


@dataclass(frozen=True)
class ConsumerRow:
    """One consumer of the folder: ``verdict`` ✓ (computes the same, checked), ✗ (computes another function) or
    ``not run here``; ``how`` says what was checked, with figures."""

    consumer: str
    verdict: str
    how: str


def _mlx_row(model: Path, config: dict[str, Any], text: str) -> ConsumerRow:
    name = f"mlx-lm ({MLX_LM.checked})"
    differs = [c for c in (converter_caveat(config), rope_caveat(config)) if c and "mlx-lm" in c]
    if differs:
        return ConsumerRow(name, "✗", differs[0])
    if importlib.util.find_spec("mlx_lm") is None:
        return ConsumerRow(name, "not run here", "mlx-lm is not installed where this repo was packaged")
    import numpy as np
    from transformers import AutoTokenizer

    from moetool.export.heldout import reference_logits, windows
    from moetool.export.mlx.runtime import mlx_logits

    mlx_utils = importlib.import_module("mlx_lm.utils")
    tok = AutoTokenizer.from_pretrained(str(model))
    lens = sorted({min(n, int(config.get("max_position_embeddings") or 128)) for n in (32, 128)})
    probes, _ = windows(tok, text, lens, 1)
    theirs, _ = mlx_utils.load_model(model)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype="float32").eval()
    diffs = {
        len(ids): float(np.abs(mlx_logits(theirs, ids) - ref).max())
        for ids, ref in zip(probes, reference_logits(hf, probes), strict=True)
    }
    figures = ", ".join(f"{d:.1e} @{n}" for n, d in diffs.items())
    same = config.get("dtype", config.get("torch_dtype")) in (None, "float32") and max(diffs.values()) <= TOLERANCE
    verdict = "✓" if same else "≈"
    return ConsumerRow(name, verdict, f"`mlx_lm.load` of this folder: max abs Δlogit {figures} tokens")


def _llama_row(config: dict[str, Any], artifacts: list[Artifact]) -> ConsumerRow:
    rec = model_record(config.get("model_type"))
    name = "llama.cpp"
    ggufs = [a for a in artifacts if a.target == "gguf" and isinstance(a.manifest.parity, ParityRecord)]
    caveat = converter_caveat(config)
    if caveat and "convert_hf_to_gguf" in caveat:
        own = f"; the packaged GGUF (`{ggufs[0].repo_dir}/{ggufs[0].file}`) is moetool's exact form" if ggufs else ""
        return ConsumerRow(name, "✗ (its converter)", caveat.split(". ")[0] + own)
    how = (
        f"its converter writes this {config.get('model_type')} as llama.cpp's "
        f"{rec.gguf.name if rec else '?'!r} with the same top-k rule and rope (CI: tests/export/"
        "test_converter_roundtrip.py converts every output architecture and compares logits)"
    )
    if ggufs:
        a = ggufs[0]
        parity = a.manifest.parity
        assert isinstance(parity, ParityRecord)  # ggufs holds only verified ones
        gate = f", margin gate {'pass' if parity.gate.passed else 'fail'}" if parity.gate is not None else ""
        how = (
            f"the packaged GGUF `{a.repo_dir}/{a.file}` in llama.cpp: {parity.outcome}, max abs Δlogit "
            f"{parity.worst_logit_diff or 0.0:.1e}{gate}; {how}"
        )
    return ConsumerRow(name, "✓", how)


def _vllm_row(config: dict[str, Any]) -> ConsumerRow:
    mt = str(config.get("model_type"))
    name = f"vLLM ({VLLM.checked})"
    if mt not in VLLM.topk:
        return ConsumerRow(name, "not run here", f"no rule recorded for {mt}")
    return ConsumerRow(
        name, "not run here (needs a GPU)", "its class reads the same keys and top-k rule as transformers"
    )


def consumer_matrix(model: Path, config: dict[str, Any], artifacts: list[Artifact], text: str) -> list[ConsumerRow]:
    """Every consumer moetool knows, for the model folder ``model`` with config dict ``config``; ``text`` is the
    held-out text mlx-lm is compared on."""
    return [
        ConsumerRow("transformers", "reference", "float32: the figures above are against it"),
        _llama_row(config, artifacts),
        _mlx_row(model, config, text),
        _vllm_row(config),
    ]


def consumers_section(rows: list[ConsumerRow]) -> str:
    """The card's "Where it runs" section."""
    lines = "\n".join(f"| {r.consumer} | {r.verdict} | {r.how} |" for r in rows)
    return (
        "## Where it runs\n\nThe folder as other runtimes load it, each against transformers; ✓ computes the same "
        "(checked), ✗ computes another function (why), ≈ within 16-bit rounding.\n\n"
        "| consumer | verdict | checked |\n|---|---|---|\n" + lines + "\n\n"
    )
