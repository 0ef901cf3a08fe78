"""ONNX export proven in onnxruntime: tiny Mixtral (3 experts) and Qwen2-MoE with a shared expert."""

from __future__ import annotations

import onnx
import pytest

from conftest import write_recipe
from moetool.api import assemble, export, plan_export
from moetool.export import ExportError

EXPERTS = """experts:
  - {{name: a, source: {e1}, positive_prompts: ["def main():"]}}
  - {{name: b, source: {e2}, positive_prompts: ["Permission is hereby granted"]}}
  - {{name: c, source: {e3}, positive_prompts: ["acute bronchitis"]}}
"""


def _merge(tmp, m, name, extra=""):
    text = f"name: {name}\nmethod: mofe\nbase_model: {m['base']}\n{extra}\n" + EXPERTS.format(**m)
    return assemble(write_recipe(tmp / f"{name}.yaml", text), tmp / name)


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
    assert {"model.onnx", "genai_config.json", "tokenizer.json", "config.json"} <= set(man["files"])
    # the routed experts as one onnxruntime MoE node per layer: no expert MatMul left in the graph
    assert _ops(tmp_path / "o" / "model.onnx")["MoE"] == 2 and man["moe_kernel"]["kind"] == "sparse"
    # onnxruntime-genai drives the folder as it is and generates transformers' greedy tokens
    assert man["generation"]["tokens_equal"] and man["generation"]["new_tokens"] == 16


def test_mixtral_mixed_precision_quantizes_experts(mixtral, tmp_path):
    dense = {"moe_kernel": "dense"}  # every expert a MatMul the node quantizer reaches (the sparse form: below)
    f32 = export(mixtral, tmp_path / "f32", target="onnx", quant="f32", verify=False, options=dense)
    man = export(mixtral, tmp_path / "q", target="onnx", quant="experts=q4_0,router=f32,*=q8_0", options=dense)
    # 2 layers × 3 experts × 3 projections at 4 bits; attention (4 × 2), head and embedding at 8 bits (the
    # embedding as int8 rows and block scales: two Gathers)
    assert man["quantized_nodes"] == {"int4": 18, "int8": 10}
    assert not any("left fp32" in n for n in man["notes"])
    ops = _ops(tmp_path / "q" / "model.onnx")
    assert ops["MatMulNBits"] == 27 and ops["Gather"] == 2
    four = export(
        mixtral, tmp_path / "q4", target="onnx", quant="experts=q4_0,embeddings=q4_0,router=f32,*=q8_0", options=dense
    )
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


def test_default_plan_is_one_the_graph_targets_accept(mixtral, tmp_path):
    # no --quant, no recipe section, no device: gguf's default (f16) is not storable in a graph runtime
    for target in ("onnx", "tflite", "coreml", "executorch"):
        _, req, plan = plan_export(mixtral, tmp_path / target, target=target)
        assert req.quant.preset == "f32" and set(plan.precisions().values()) == {"fp32"}
    _, req, _ = plan_export(mixtral, tmp_path / "g", target="gguf")
    assert req.quant.preset == "f16"


def test_runner_convention_batch_left_padding_and_empty_past(mixtral, tmp_path):
    """One graph serves prefill (empty past) and decode, batch 2 with the second row left-padded, each row equal to
    transformers on its own unpadded tokens."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM

    export(mixtral, tmp_path / "o", target="onnx", quant="f32", verify=False)
    graph = onnx.load(str(tmp_path / "o" / "model.onnx")).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert dims["past_key_values.1.value"][::2] == ["batch_size", "past_sequence_length"]
    s = ort.InferenceSession(str(tmp_path / "o" / "model.onnx"), providers=["CPUExecutionProvider"])
    hf = AutoModelForCausalLM.from_pretrained(str(mixtral), dtype=torch.float32).eval()
    n, kv, hd = hf.config.num_hidden_layers, hf.config.num_key_value_heads, hf.config.head_dim
    names = [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    ids = torch.randint(4, hf.config.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": pos.numpy()}
    out = s.run(None, feeds | {k: np.zeros((2, kv, 0, hd), np.float32) for k in names})
    nxt = torch.randint(4, hf.config.vocab_size, (2, 1))
    feeds = {
        "input_ids": nxt.numpy(),
        "attention_mask": torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1).numpy(),
        "position_ids": (pos[:, -1:] + 1).numpy(),
    }
    step = s.run(None, feeds | dict(zip(names, out[1:], strict=True)))
    assert step[1].shape == (2, kv, 13, hd)
    with torch.no_grad():
        for row, start in ((0, 0), (1, 5)):
            ref = hf(torch.cat([ids[row : row + 1, start:], nxt[row : row + 1]], 1)).logits[0].numpy()
            assert np.abs(out[0][row, start:] - ref[:-1]).max() < 1e-4
            assert np.abs(step[0][row, -1] - ref[-1]).max() < 1e-4


@pytest.mark.parametrize("normalize", [True, False])
def test_sparse_moe_op_equals_the_dense_masked_block(normalize):
    """moetool::sparse_moe (what the ONNX MoE node computes) against the dense-masked block every graph target uses."""
    import torch

    from moetool.export.graph.model import DenseMaskedMoE, GatedMLP

    torch.manual_seed(0)
    experts = [GatedMLP(torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 24)) for _ in range(4)]
    block = DenseMaskedMoE(torch.randn(4, 16), experts, top_k=2, norm_topk=normalize)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        dense = block(x)
        block.make_sparse()
        sparse = block(x)
    assert torch.allclose(dense, sparse, atol=1e-4, rtol=1e-5)


def _fake_quant_rows(w, bits):
    """Symmetric per-row round-to-nearest, as QMoE stores 8-bit experts and 4-bit ones whose widths are not
    multiples of 32 (this model's 48-wide down projections)."""
    scale = w.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    return (w / scale).round() * scale


@pytest.mark.parametrize(("quant", "bits"), [("experts=q8_0,*=f32", 8), ("experts=q4_0,*=f32", 4)])
def test_qmoe_computes_the_planned_expert_weights(mixtral, tmp_path, quant, bits):
    """A plan that quantizes the experts gives QMoE nodes whose logits equal transformers' with those experts
    fake-quantized the same way: the op's weight layout, packing, scales and routing are what moetool writes
    (with fp32 activations, ``--accuracy-level 0``; the default level 4 also quantizes activations, which parity
    reports)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    man = export(mixtral, tmp_path / "o", target="onnx", quant=quant, verify=False, accuracy_level=0)
    assert man["accuracy_level"]["level"] == 0 and man["accuracy_level"]["activations"].startswith("fp32")
    assert _ops(tmp_path / "o" / "model.onnx")["QMoE"] == 2
    assert man["moe_kernel"]["experts_quantized"][f"int{bits}"] == 6
    hf = AutoModelForCausalLM.from_pretrained(str(mixtral), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.copy_(_fake_quant_rows(ex.gate_up_proj, bits))
            ex.down_proj.copy_(_fake_quant_rows(ex.down_proj, bits))
    from moetool.export.onnx.runner import ort_runners, ort_session

    cfg = hf.config
    prefill, _ = ort_runners(ort_session(tmp_path / "o" / "model.onnx"), cfg.num_hidden_layers, 2, cfg.head_dim)
    ids = torch.randint(4, cfg.vocab_size, (1, 24))
    got = prefill(ids.numpy())[0]
    with torch.no_grad():
        ref = hf(ids).logits.numpy()
    assert np.abs(got - ref).max() < 1e-4
