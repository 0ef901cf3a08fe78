"""The card's runner matrix: each exported artifact, the LLM runner its platform's apps use, what of it moetool ran
here and the figure it gave — read from the artifact's manifest, never written twice.

| target | runner | read from the manifest |
|---|---|---|
| gguf | llama.cpp | ``parity`` (logits and perplexity in llama-cpp-python) |
| onnx | onnxruntime-genai | ``generation`` (its greedy tokens against transformers') |
| mlx | mlx-lm | ``parity`` |
| executorch | ExecuTorch's TextLLMRunner | ``runner`` (greedy generation and its own speed) |
| tflite | LiteRT-LM | ``runner`` (greedy generation of the ``.litertlm`` bundle, its own speed) |
| coreml | Core ML | nothing can run here: Core ML predicts on Apple platforms only |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetool.package.inputs import Artifact

__all__ = ["RUNNERS", "RunnerRow", "runner_rows", "runners_section"]

# target → the runner the platform's apps load its artifact in
RUNNERS = {
    "gguf": "llama.cpp (llama-cpp-python)",
    "onnx": "onnxruntime-genai",
    "mlx": "mlx-lm",
    "executorch": "ExecuTorch TextLLMRunner",
    "tflite": "LiteRT-LM (litert-lm-api)",
    "coreml": "Core ML (iOS 18 / macOS 15)",
}


@dataclass(frozen=True)
class RunnerRow:
    """One row: the ``target``, its ``runner``, what was ``run`` of it here and the ``figure`` that run gave."""

    target: str
    runner: str
    run: str
    figure: str


def _rate(record: dict[str, Any], what: str) -> str:
    value = record.get(f"{what}_tok_s")
    if isinstance(value, int | float) and value:
        return f", {what} {float(value):,.0f} tok/s"
    # ExecuTorch's runner times in whole milliseconds and gives no rate for a span that rounds to 0
    return f", {what} under 1 ms" if record.get(f"{what}_ms") == 0 else ""


def _generation(record: Any) -> tuple[str, str]:
    """(what was run, the figure) of a runner's greedy generation against transformers (ExecuTorch, LiteRT-LM,
    onnxruntime-genai records)."""
    if not isinstance(record, dict):
        return "not run", str(record or "not verified")
    if record.get("file") is None and record.get("why"):
        return "not run", str(record["why"])
    new = record.get("new_tokens") or record.get("reference_tokens")
    run = f"greedy generation of {new} tokens, against transformers'" if new else "greedy generation"
    if "same_leading_tokens" in record:
        figure = f"{record['same_leading_tokens']} of {record['new_tokens']} tokens as transformers'"
    elif "same_prefix_tokens" in record:
        figure = f"{record['same_prefix_tokens']} of {record.get('reference_tokens')} tokens as transformers'"
        figure += " (same text)" if record.get("same_text") else ""
    elif "tokens_equal" in record:
        first = record.get("first_difference")
        figure = "the same tokens" if record["tokens_equal"] else f"first difference at token {first}"
    else:
        figure = ""
    figure += _rate(record, "prefill") + _rate(record, "decode")
    return run, figure.lstrip(", ")


def _parity(parity: Any) -> tuple[str, str]:
    if not isinstance(parity, dict):
        return "not run", str(parity or "not verified")
    run = f"logits against transformers ({parity.get('runtime', 'its runtime')})"
    bits = []
    if isinstance(parity.get("top1_agreement"), int | float):
        bits.append(f"top-1 agreement {parity['top1_agreement']:.1%}")
    ppl = parity.get("ppl_change")
    if isinstance(ppl, int | float):
        bits.append(f"perplexity {ppl:+.2%}")
    return run, ", ".join(bits) or str(parity.get("verdict", ""))


def runner_rows(artifacts: list[Artifact]) -> list[RunnerRow]:
    """A row per artifact whose target has a runner (:data:`RUNNERS`), from its manifest."""
    rows = []
    for a in artifacts:
        m, target = a.manifest, a.target
        if target not in RUNNERS:
            continue
        if target in ("executorch", "tflite"):
            run, figure = _generation(m.get("runner"))
        elif target == "onnx":
            run, figure = _generation(m.get("generation"))
        elif target == "coreml":
            run, figure = (
                "not run: Core ML predicts on Apple platforms only",
                "structure and converted wrappers checked",
            )
        else:
            run, figure = _parity(m.get("parity"))
        rows.append(RunnerRow(target, RUNNERS[target], run, figure))
    return rows


def runners_section(rows: list[RunnerRow]) -> str:
    """The card's "Where the artifacts run" section (empty without rows)."""
    if not rows:
        return ""
    lines = "\n".join(f"| {r.target} | {r.runner} | {r.run} | {r.figure} |" for r in rows)
    return (
        "## Where the artifacts run\n\nEach artifact in the LLM runner its platform's apps use, as moetool ran it "
        "when it exported it (figures from each `manifest.json`).\n\n"
        "| target | runner | what was run | figure |\n|---|---|---|---|\n" + lines + "\n\n"
    )
