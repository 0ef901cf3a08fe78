"""The ONNX export streams: the graph is traced without weights, the weights are written one layer at a time and
rounded as they are written (byte for byte as onnxruntime's own quantizer rounds them), and a model whose 16-bit copy
does not fit is exported and verified anyway, against a reference streamed from disk."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from streamed_fixtures import deep_moe as deep_moe_at
from streamed_fixtures import live_tensor_bytes

from moetool.api import export
from moetool.compute.upcast import layer_bytes
from moetool.export.onnx import weights
from moetool.export.onnx.layout import Stored
from moetool.io.budget import BudgetError
from moetool.io.checkpoint import Checkpoint


@pytest.mark.parametrize(("bits", "k"), [(4, 64), (4, 48), (8, 64)])
def test_matmul_nbits_weights_are_what_onnxruntimes_quantizer_writes(bits, k):
    """One projection rounded as it is streamed equals onnxruntime's MatMulNBitsQuantizer on the whole graph: the
    packed weights and the scales, including a width that is not a multiple of the block (padded as it pads)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    n = 40
    w = np.random.default_rng(bits + k).normal(size=(n, k)).astype(np.float32)  # [N, K], as nn.Linear stores it
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [numpy_helper.from_array(np.ascontiguousarray(w.T), "w")],
    )
    q = MatMulNBitsQuantizer(onnx.helper.make_model(graph), bits=bits, block_size=32, is_symmetric=True)
    q.process()
    inits = {i.name: numpy_helper.to_array(i) for i in q.model.model.graph.initializer}
    stored = Stored("proj", "nbits", (), bits=bits, block=32)
    packed, scales = weights.encode(stored, torch.from_numpy(w))
    assert np.array_equal(packed, inits[f"w_Q{bits}"])
    assert np.array_equal(scales, inits["w_scales"])


@pytest.fixture(scope="module")
def deep_moe(tmp_path_factory):
    return deep_moe_at(tmp_path_factory.mktemp("onnx-deep"))


def test_weights_are_written_one_layer_at_a_time_and_checked_against_a_streamed_reference(
    deep_moe, tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    from moetool.api import plan_export
    from moetool.compute.upcast import float32_overhead
    from moetool.export.onnx.exporter import SESSION_MULTIPLE
    from moetool.export.reference import VERIFY_OVERHEAD, streamed_need

    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    quant = "experts=q4_0,router=f32,*=q8_0"
    config = Checkpoint(deep_moe).config
    params = sum(t.numel() for t in load_file(str(next(deep_moe.glob("*.safetensors")))).values())
    outside, layer = layer_bytes(config, params)
    artifact = plan_export(deep_moe, tmp_path / "plan", target="onnx", quant=quant)[2].quant.total_bytes
    # the artifact's session and one streamed layer fit; the bf16 model held does not
    low = streamed_need(params, config) + int(artifact * SESSION_MULTIPLE)
    high = params * 2 + float32_overhead(params, config) + VERIFY_OVERHEAD
    assert low < high
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str((low + high) // 2))
    before = live_tensor_bytes()  # what earlier tests (module fixtures, caches) left alive in this process
    peak = [0]
    encode = weights.encode

    def measured(stored, tensor):
        peak[0] = max(peak[0], live_tensor_bytes() - before)
        return encode(stored, tensor)

    monkeypatch.setattr(weights, "encode", measured)
    man = export(deep_moe, tmp_path / "o", target="onnx", quant=quant)
    # never the model whole: the weights outside the layers, one layer and its fused experts, one tensor rounding
    # (and up to 256 KiB of what else the run creates: rope tables, tokenizer and loader caches)
    assert peak[0] <= outside + layer * 5 // 2 + (256 << 10), (peak[0], outside, layer)
    assert peak[0] < outside + 4 * layer < params * 4
    assert man["accuracy_level"]["level"] == 4  # the default: int8 activations
    p = man["parity"]
    assert p["reference"] == "transformers float32, layer by layer streamed from disk over bfloat16 weights"
    assert "export_model_vs_transformers" not in p  # no torch model was held to compare
    assert man["moe_kernel"] == {
        "kind": "sparse",
        "op": "QMoE (com.microsoft, onnxruntime only)",
        "layers": 8,
        "experts_quantized": {"int8": 0, "int4": 24},
    }
    assert man["quantized_nodes"] == {"int8": 8 * 4 + 2, "int4": 0}  # attention, the head and the embedding
    assert abs(p["ppl_change"]) < 0.05
    assert {"model.onnx", "model.onnx.data"} <= set(man["files"])
    # the same artifact checked against the float32 model held whole: the same figures
    monkeypatch.delenv("MOETOOL_MEMORY_BUDGET")
    held = export(deep_moe, tmp_path / "held", target="onnx", quant=quant)["parity"]
    assert held["reference"] == "transformers float32"
    assert max(held["export_model_vs_transformers"].values()) < 1e-4
    for n, diff in held["max_abs_logit_diff"].items():
        assert p["max_abs_logit_diff"][n] == pytest.approx(diff, abs=1e-4)
    assert p["ppl_reference"] == pytest.approx(held["ppl_reference"], rel=1e-5)
    assert p["ppl_artifact"] == pytest.approx(held["ppl_artifact"], rel=1e-5)
    assert p["decode"]["max_abs_logit_diff"] == pytest.approx(held["decode"]["max_abs_logit_diff"], abs=1e-4)


def test_refused_up_front_when_one_layer_does_not_fit(deep_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(64 << 20))
    with pytest.raises(BudgetError, match="one layer at a time"):
        export(deep_moe, tmp_path / "o", target="onnx", quant="experts=q4_0,*=q8_0")
    assert not (tmp_path / "o").exists()


def test_4bit_experts_in_blocks_compute_the_planned_weights(deep_moe, tmp_path):
    """QMoE's block-wise 4-bit experts (widths that are multiples of 32) equal transformers running the experts
    rounded the same way, symmetric per block of 32, with fp32 activations (``--accuracy-level 0``)."""
    from transformers import AutoModelForCausalLM

    from moetool.export.onnx.runner import ort_runners, ort_session

    man = export(deep_moe, tmp_path / "o", target="onnx", quant="experts=q4_0,*=f32", verify=False, accuracy_level=0)
    assert man["moe_kernel"]["experts_quantized"] == {"int8": 0, "int4": 24} and not man["notes"]

    def rounded(w: torch.Tensor) -> torch.Tensor:  # [E, N, K], blocks of 32 along K, zero point 8
        blocks = w.reshape(*w.shape[:2], -1, 32)
        scale = blocks.abs().amax(-1, keepdim=True) / 7
        q = (torch.round(blocks / scale) + 8).clamp(0, 15) - 8
        return (q * scale).reshape(w.shape)

    hf = AutoModelForCausalLM.from_pretrained(str(deep_moe), dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.copy_(rounded(layer.mlp.experts.gate_up_proj))
            layer.mlp.experts.down_proj.copy_(rounded(layer.mlp.experts.down_proj))
    cfg = hf.config
    session = ort_session(tmp_path / "o" / "model.onnx")
    prefill, _ = ort_runners(session, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    ids = torch.randint(4, cfg.vocab_size, (1, 24))
    with torch.no_grad():
        assert np.abs(prefill(ids.numpy())[0] - hf(ids).logits.numpy()).max() < 1e-4
