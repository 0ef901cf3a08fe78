"""ONNX export proven in onnxruntime: tiny Mixtral (3 experts) and Qwen2-MoE with a shared expert."""

from __future__ import annotations

import onnx
import pytest

from conftest import write_recipe
from moetool.api import export, merge, plan_export
from moetool.export import ExportError

EXPERTS = """experts:
  - {{name: a, source: {e1}, positive_prompts: ["def main():"]}}
  - {{name: b, source: {e2}, positive_prompts: ["Permission is hereby granted"]}}
  - {{name: c, source: {e3}, positive_prompts: ["acute bronchitis"]}}
"""


def _merge(tmp, m, name, extra=""):
    text = f"name: {name}\nmethod: mofe\nbase_model: {m['base']}\n{extra}\n" + EXPERTS.format(**m)
    return merge(write_recipe(tmp / f"{name}.yaml", text), tmp / name)


@pytest.fixture(scope="module")
def mixtral(tiny_models, tmp_path_factory):
    return _merge(tmp_path_factory.mktemp("onnx-mx"), tiny_models("llama"), "mx")


def _ops(path):
    out: dict[str, int] = {}
    for n in onnx.load(str(path)).graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def test_mixtral_fp32_two_lengths_and_decode(mixtral, tmp_path):
    man = export(mixtral, tmp_path / "o", target="onnx", quant="f32")
    p = man["parity"]
    assert p["seq_lens"] == [32, 128]
    assert max(p["max_abs_logit_diff"].values()) <= 1e-4
    assert p["decode"]["max_abs_logit_diff"] <= 1e-4 and p["decode"]["steps"] == 8
    assert max(p["export_model_vs_transformers"].values()) <= 1e-5
    assert p["top1_agreement"] == 1.0
    assert set(man["files"]) == {"model.onnx", "model-with-past.onnx"}
    assert "TopK" in _ops(tmp_path / "o" / "model.onnx")


def test_mixtral_mixed_precision_quantizes_experts(mixtral, tmp_path):
    f32 = export(mixtral, tmp_path / "f32", target="onnx", quant="f32", verify=False)
    man = export(mixtral, tmp_path / "q", target="onnx", quant="experts=q4_0,router=f32,*=q8_0")
    # 2 layers × 3 experts × 3 projections at 4 bits; attention (4 × 2) and head at 8 bits; onnxruntime quantizes
    # the embedding Gather only at 4 bits, and the manifest says so
    assert man["quantized_nodes"] == {"int4": 18, "int8": 9}
    assert any("node_embedding planned int8 but left fp32" in n for n in man["notes"])
    ops = _ops(tmp_path / "q" / "model.onnx")
    assert ops["MatMulNBits"] == 27 and ops["Gather"] == 1
    four = export(mixtral, tmp_path / "q4", target="onnx", quant="experts=q4_0,embeddings=q4_0,router=f32,*=q8_0")
    assert _ops(tmp_path / "q4" / "model.onnx")["GatherBlockQuantized"] == 1 and four["quantized_nodes"]["int4"] == 19
    # left in fp32: the routers (2) and attention's activation×activation products (2 per layer)
    assert ops["MatMul"] == 2 + 4
    assert man["artifact"]["bytes"] < 0.6 * f32["artifact"]["bytes"]
    p = man["parity"]
    assert 0.5 < p["top1_agreement"] <= 1.0 and p["ppl_artifact"] > 0


def test_qwen2_moe_shared_expert(tiny_models, tmp_path):
    m = tiny_models("qwen2")
    moe = _merge(tmp_path, m, "q2", f"shared_expert: {{source: {m['base']}, positive_prompts: ['def']}}")
    p = export(moe, tmp_path / "o", target="onnx", quant="f32")["parity"]
    assert max([*p["max_abs_logit_diff"].values(), p["decode"]["max_abs_logit_diff"]]) <= 1e-4


def test_unsupported_precision_names_what_is_supported(mixtral, tmp_path):
    with pytest.raises(ExportError, match="graph targets take f32, 8-bit or 4-bit weights"):
        plan_export(mixtral, tmp_path / "o", target="onnx", quant="f16")
