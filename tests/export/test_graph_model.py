"""ExportLM, the export-friendly model every graph target converts, equals transformers before any conversion."""

from __future__ import annotations

import pytest
import torch
import transformers

from moetool.export.graph.model import ExportLM, causal_mask, prefill_inputs

CASES = {
    "mixtral": ("MixtralConfig", {}),
    "qwen2_moe-shared": ("Qwen2MoeConfig", {"shared_expert_intermediate_size": 16, "moe_intermediate_size": 24}),
    "qwen2_moe-unnormalised": (
        "Qwen2MoeConfig",
        {"shared_expert_intermediate_size": 16, "moe_intermediate_size": 24, "norm_topk_prob": False},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", {"moe_intermediate_size": 24, "head_dim": 8}),
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
}


def _model(cls: str, extra: dict) -> transformers.PreTrainedModel:
    cfg = getattr(transformers, cls)(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=3,
        num_experts=3,
        num_experts_per_tok=2,
        **extra,
    )
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)  # larger than the init, so routing and attention differences show
    return m


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_cached_decode_match_transformers(case):
    hf = _model(*CASES[case])
    em = ExportLM(hf).eval()
    ids = torch.randint(0, 64, (2, 13))
    with torch.no_grad():
        ref = hf(ids).logits
        out = em(*prefill_inputs(ids))
        assert (out[0] - ref).abs().max() <= 1e-5
        assert len(out) == 1 + 2 * 2 and out[1].shape == (2, 2, 13, 8)  # [B, kv heads, T, head_dim]
        o = em(*prefill_inputs(ids[:, :9]))
        past, steps = o[1:], []
        for t in range(9, 13):
            o = em(ids[:, t : t + 1], torch.full((2, 1), t), causal_mask(1, t, 2), *past)
            past = o[1:]
            steps.append(o[0])
        assert (torch.cat(steps, 1) - ref[:, 9:]).abs().max() <= 1e-5


def test_causal_mask():
    m = causal_mask(2, 3)
    assert m.shape == (1, 1, 2, 5)
    assert (m[0, 0, 0, :4] == 0).all() and m[0, 0, 0, 4] < -1e8 and (m[0, 0, 1] == 0).all()


def test_unsupported_family_is_named():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64)
    with pytest.raises(ValueError, match="graph export supports llama"):
        ExportLM(transformers.AutoModelForCausalLM.from_config(cfg))


@pytest.mark.parametrize(("case", "layers"), [("mixtral", 2), ("qwen2_moe-shared", 2), ("llama", 0)])
def test_dense_moe_kernel_record(case, layers):
    from moetool.export.graph.moe_kernel import dense_moe_kernel

    em = ExportLM(_model(*CASES[case]))
    assert em.moe_layers() == layers
    for target in ("executorch", "tflite", "coreml"):
        rec = dense_moe_kernel(target, em.moe_layers())
        assert rec["kind"] == "dense-masked" and rec["layers"] == layers
        assert (rec["reason"] is None) == (layers == 0)  # a dense model has no experts to select
    with pytest.raises(ValueError, match="onnx"):
        dense_moe_kernel("onnx", 2)  # ONNX writes its own record (sparse MoE/QMoE or dense)
