"""The typed parity record: every layout a manifest has held reads back and writes out unchanged."""

from __future__ import annotations

import pytest

from moetool.export.gate import GateReport
from moetool.export.heldout import Agreement
from moetool.export.parity import (
    NOT_VERIFIED,
    BundleParity,
    DecodeCheck,
    ParityRecord,
    Refused,
    RouteCheck,
    parity_of,
)

GATE = GateReport(
    family="q8_0", tokens=508, decisive=400, agreement=0.995, min_agreement=0.98, min_decisive=16,
    noise_median=0.01, noise_p99=0.03, noise_max=0.05, safety=2.0, floor=0.0, kl_mean=0.002, kl_max=0.02,
    kl_rounding=0.001, kl_family_bound=0.03, kl_bound=0.03, rounding={"q8_0": 0.004}, raw_top1=0.97,
    raw_top1_conversion=0.99,
)  # fmt: skip

FIGURES = {
    "max_abs_logit_diff": {"32": 1.2e-5, "128": 3.4e-5},
    "top1_agreement": 1.0,
    "ppl_reference": 12.5,
    "ppl_artifact": 12.5,
    "ppl_change": 0.0,
}
GRAPH = {
    "runtime": "onnxruntime 1.22.0",
    "reference": "transformers float32",
    "seq_lens": [32, 128],
    "max_abs_logit_diff": {"32": 1.2e-5, "128": 3.4e-5},
    "export_model_vs_transformers": {"32": 1e-6, "128": 2e-6},
    "decode": {"prefill_tokens": 120, "steps": 8, "max_abs_logit_diff": 5e-5},
    **FIGURES,
    "tokens_scored": 508,
    "text": "builtin-sample",
}
GGUF = {
    "runtime": "llama-cpp-python",
    "reference": "transformers float32",
    "tokenizer_match": False,
    "tokenizer_probes": 10,
    "tokenizer_mismatches": [{"text": "a  b", "hf": [1, 2], "llama_cpp": [1, 3]}],
    "seq_lens": [32, 128],
    "tokens_scored": 508,
    **FIGURES,
    "conversion": FIGURES | {"reference": "transformers float32, on the artifact's dequantized weights"},
    "gate": GATE.to_json(),
    "text": "zoo",
}
MAMBA = {k: v for k, v in GGUF.items() if k not in ("tokenizer_probes", "conversion", "tokens_scored", "text")}
MLX = {
    "runtime": "mlx 0.29 / mlx-lm 0.28",
    "reference": "transformers float32",
    "tokenizer_match": True,
    "tokenizer_probes": 8,
    "weights": {"modules": 211, "identical": 211, "differing": []},
    "seq_lens": [32, 128],
    "decode": {"prefill_tokens": 120, "steps": 8, "max_abs_logit_diff": 1e-4},
    **FIGURES,
    "tokens_scored": 508,
    "text": "zoo",
}
GEM_TOKEN = {
    "runtime": "onnxruntime",
    "reference": "PyTorch moetool_gem float32",
    "seq_lens": [32, 128],
    "windows": 8,
    "tokens": 640,
    "max_abs_logit_diff": 3e-5,
    "max_abs_prob_diff": 1e-6,
    "route_mismatches": 1,
    "route_mismatches_off_boundary": 0,
    "top1_agreement": 1.0,
    "ppl_reference": 20.1,
    "ppl_artifact": 20.1,
    "route_share": {"general": 0.5, "code": 0.5},
}
GEM_ROUTER = {"windows": 8, "seq_lens": [32, 128], "max_abs_prob_diff": 2e-7, "same_route": 8}
HYBRID_ROUTER = {
    "runtime": "onnxruntime 1.22.0",
    "reference": "PyTorch router on features built as in training",
    "requests": 64,
    "max_abs_score_diff": 1e-7,
    "choice_agreement": 1.0,
}
COREML = GRAPH | {"core_ml_runtime": "not run: Core ML prediction needs macOS (scripts/coreml_parity_mac.py)"}
EMBEDDING_COREML = {
    "runtime": "none on Linux (Core ML runs on Apple platforms only)",
    "converted_wrapper_vs_transformers": {"32": 1e-6},
    "text": "zoo",
}
BUNDLE = {
    "router": GEM_ROUTER,
    "members": {"general": GRAPH, "code": {"exported": False, "reason": "no"}, "legal": NOT_VERIFIED},
}
LAYOUTS = [GRAPH, GGUF, MAMBA, MLX, GEM_TOKEN, GEM_ROUTER, HYBRID_ROUTER, COREML, EMBEDDING_COREML, BUNDLE]


@pytest.mark.parametrize("doc", LAYOUTS, ids=lambda d: str(d.get("runtime", "router" in d and "bundle")))
def test_every_layout_round_trips(doc):
    assert ParityRecord.from_json(doc).to_json() == doc


def test_the_typed_fields_are_read():
    g = ParityRecord.from_json(GGUF)
    assert g.gate == GATE and g.outcome == "pass" and g.tokenizer is not None and not g.tokenizer.match
    assert g.conversion is not None and g.conversion.max_abs_logit_diff == {"32": 1.2e-5, "128": 3.4e-5}
    graph = ParityRecord.from_json(GRAPH)
    assert graph.decode == DecodeCheck(120, 8, 5e-5) and graph.worst_logit_diff == 5e-5
    assert graph.outcome == "reported"  # an old manifest recorded no tolerance
    gem = ParityRecord.from_json(GEM_TOKEN)
    assert gem.routes == RouteCheck(
        max_abs_prob_diff=1e-6, mismatches=1, mismatches_off_boundary=0, share={"general": 0.5, "code": 0.5}
    )
    assert gem.worst_logit_diff == 3e-5 and gem.extra == {}
    emb = ParityRecord.from_json(EMBEDDING_COREML)
    assert emb.extra == {"converted_wrapper_vs_transformers": {"32": 1e-6}}
    bundle = ParityRecord.from_json(BUNDLE).bundle
    assert isinstance(bundle, BundleParity) and bundle.router is not None and bundle.router.routes is not None
    assert bundle.members["code"] == Refused("no") and bundle.members["legal"] == NOT_VERIFIED


def test_a_judged_record_writes_its_tolerance_and_verdict():
    vs = Agreement({"32": 2e-5, "128": 5e-5}, 0.99999991, 10.123456, 10.123457)
    record = ParityRecord(runtime="onnxruntime", reference="transformers float32", seq_lens=(32, 128))
    record = record.with_figures(vs)
    assert record.top1_agreement == 1.0 and record.ppl_reference == 10.1235
    ok = record.judged(1e-4)
    assert ok.verdict == "pass" and ok.to_json()["tolerance"] == 1e-4 and ok.to_json()["verdict"] == "pass"
    assert record.judged(1e-5).outcome == "fail"
    assert record.judged(None).verdict == "reported"
    assert ParityRecord.from_json(ok.to_json()) == ok


def test_parity_of_a_manifest_value():
    assert parity_of(NOT_VERIFIED) == NOT_VERIFIED
    assert parity_of(None) is None and parity_of(3) is None
    assert parity_of(GRAPH) == ParityRecord.from_json(GRAPH)


def test_the_record_in_words_has_the_verdict_and_the_gate():
    from moetool.export.parity_text import describe

    judged = ParityRecord.from_json(GGUF)
    text = describe(judged)
    assert text.startswith("pass (margin gate, q8_0 plan): max abs Δlogit 1.2e-05 @32, 3.4e-05 @128 tokens")
    assert "margin gate pass: top-1 99.50% on 400 decisive tokens" in text and "tokenizer DIFFERS on 10 probes" in text
    assert "|" not in text  # it goes into a Markdown table cell
    graph = ParityRecord.from_json(GRAPH).judged(1e-4)
    assert describe(graph).startswith("pass (max abs Δlogit ≤ 0.0001): ")
    assert "max abs ΔP 1.0e-06; 1 route(s) differ (0 off the tau boundary)" in describe(
        ParityRecord.from_json(GEM_TOKEN)
    )
    bundle = describe(ParityRecord.from_json(BUNDLE))
    assert "router: reported" in bundle and "same route on 8 of 8 windows" in bundle
    assert "code: not exported (no)" in bundle and f"legal: {NOT_VERIFIED}" in bundle
    assert describe(NOT_VERIFIED) == NOT_VERIFIED


def test_the_cli_prints_the_verdict_and_the_gate(capsys):
    from moetool.cli import render

    render.print_parity(ParityRecord.from_json(GGUF))
    printed = capsys.readouterr().out
    assert "parity (llama-cpp-python vs transformers float32, zoo text): pass (margin gate, q8_0 plan)" in printed
    assert "gate (q8_0 plan): pass: top-1 0.9950 on 400 of 508 decisive tokens" in printed


def test_the_float32_gate_scales_with_the_reference_logits():
    """A float32 artifact is held to 1e-4 per unit of the reference's largest |logit|: the real 30-layer MoE (logits
    up to about 20) differs by 2.8e-4 in LiteRT's float32 kernels, within its gate; a tiny model's logits (under one
    unit) keep 1e-4 itself, and the record keeps the scale it was judged at."""
    from moetool.export import ExportError
    from moetool.export.graph.parity import judge

    real = ParityRecord(max_abs_logit_diff={"32": 2.8e-4, "128": 2.1e-4}, reference_max_logit=20.3)
    held = judge(real, "TFLite (fp32)")
    assert held.verdict == "pass" and held.tolerance == pytest.approx(2.03e-3)
    assert ParityRecord.from_json(held.to_json()).reference_max_logit == 20.3
    tiny = ParityRecord(max_abs_logit_diff={"32": 2.8e-4}, reference_max_logit=0.4)
    with pytest.raises(ExportError, match=r"max \|Δlogit\| 0.00028 > 0.0001$"):
        judge(tiny, "TFLite (fp32)")
    with pytest.raises(ExportError, match=r"> 0.00203 \(0.0001 per unit of the reference's largest \|logit\|, 20.3\)"):
        judge(ParityRecord(max_abs_logit_diff={"32": 3e-3}, reference_max_logit=20.3), "TFLite (fp32)")
