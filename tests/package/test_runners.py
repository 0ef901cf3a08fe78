"""The card's runner matrix reads each artifact's manifest: the runner its platform's apps use, what moetool ran of
it and the figure, or why it was not run."""

from __future__ import annotations

from moetool.export.base import Manifest
from moetool.package.inputs import Artifact
from moetool.package.runners import runner_rows, runners_section


def _artifact(tmp_path, target, **fields):
    doc = {"format": target, "target": target, "file": f"model.{target}", "files": {}, **fields}
    return Artifact(tmp_path / target, Manifest(doc))


def test_each_target_in_its_runner(tmp_path):
    et = {"new_tokens": 16, "same_leading_tokens": 16, "prefill_tok_s": 412.5, "decode_tok_s": 38.2}
    # a prefill the runner timed at 0 ms (it then gives no rate)
    fast = {**et, "prefill_ms": 0, "prefill_tok_s": None, "decode_ms": 40}
    lm = {"file": "model.litertlm", "reference_tokens": 18, "same_prefix_tokens": 18, "same_text": True}
    chunked = {"file": None, "why": "LiteRT-LM runs one decoder model; this export is 6 chunks"}
    rows = runner_rows(
        [
            _artifact(tmp_path, "executorch", runner=et),
            _artifact(tmp_path, "executorch", runner=fast),
            _artifact(tmp_path, "tflite", runner=lm),
            _artifact(tmp_path, "tflite", runner=chunked),
            _artifact(tmp_path, "onnx", generation={"new_tokens": 16, "tokens_equal": False, "first_difference": 9}),
            _artifact(tmp_path, "gguf", parity={"runtime": "llama.cpp", "top1_agreement": 0.79, "ppl_change": 0.226}),
            _artifact(tmp_path, "coreml"),
        ]
    )
    got = {(r.target, r.figure) for r in rows}
    assert ("executorch", "16 of 16 tokens as transformers', prefill 412 tok/s, decode 38 tok/s") in got
    assert ("executorch", "16 of 16 tokens as transformers', prefill under 1 ms, decode 38 tok/s") in got
    assert ("tflite", "18 of 18 tokens as transformers' (same text)") in got
    assert ("tflite", chunked["why"]) in got
    assert ("onnx", "first difference at token 9") in got
    assert ("gguf", "top-1 agreement 79.0%, perplexity +22.60%") in got
    assert [r.runner for r in rows if r.target == "coreml"] == ["Core ML (iOS 18 / macOS 15)"]
    section = runners_section(rows)
    assert section.startswith("## Where the artifacts run") and section.count("\n| ") == 7 + 1


def test_no_artifacts_no_section():
    assert runners_section([]) == ""
