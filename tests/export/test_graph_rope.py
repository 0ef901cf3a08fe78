"""Scaled rope in ExportLM (the model every graph target converts) equals transformers inside and past the original
context; the same weights with unscaled rope differ, so a model that ignored the scaling fails."""

from __future__ import annotations

import pytest
import torch
import transformers
from rope_cases import LONG, LONGROPE_ORIG, ORIG, SHORT, rope_kwargs, unscaled_kwargs

from moetool.export.graph.model import ExportLM, causal_mask, prefill_inputs
from moetool.export.graph.static import StaticCacheLM, static_mask

MOE = {"num_local_experts": 3, "num_experts": 3, "num_experts_per_tok": 2}
CASES = {
    "mixtral-llama3": ("MixtralConfig", "llama3", {}),
    "qwen2_moe-yarn": ("Qwen2MoeConfig", "yarn", {"shared_expert_intermediate_size": 16, "moe_intermediate_size": 24}),
    "qwen3_moe-yarn-attention": ("Qwen3MoeConfig", "yarn-attention", {"moe_intermediate_size": 24, "head_dim": 8}),
    "llama-linear": ("LlamaConfig", "linear", {}),
    "llama-longrope": ("LlamaConfig", "longrope", {}),
}


def _pair(cls: str, case: str, extra: dict) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedModel]:
    """(scaled, unscaled): the same weights under the case's rope and under plain rope."""
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4)
    common |= dict(num_key_value_heads=2, **MOE, **extra)
    torch.manual_seed(0)
    scaled = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**common, **rope_kwargs(case)))
    with torch.no_grad():
        for p in scaled.parameters():
            p.normal_(0, 0.2)
    plain = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**common, **unscaled_kwargs()))
    plain.load_state_dict(scaled.state_dict())
    return scaled.eval(), plain.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_transformers_inside_and_past_the_original_context(case):
    cls, rope, extra = CASES[case]
    hf, plain = _pair(cls, rope, extra)
    em = ExportLM(hf).eval()
    orig = LONGROPE_ORIG if rope == "longrope" else ORIG
    assert SHORT < orig < LONG
    for n in (SHORT, LONG):
        ids = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            ref, off = hf(ids).logits, plain(ids).logits
            out = em(*prefill_inputs(ids))[0]
        diff, moved = float((out - ref).abs().max()), float((out - off).abs().max())
        assert diff <= 1e-5, (n, diff)  # measured 1e-7 to 5e-7
        assert moved > 1e-3, (n, moved)  # the scaling changes the result at this length (measured >= 5e-3)


def test_longrope_decode_crosses_the_switch_like_transformers():
    """Prefill below original_max_position_embeddings, then decode past it: the new tokens switch to the long
    factors while the cached keys keep the short ones, in transformers and in ExportLM alike."""
    hf, _ = _pair("LlamaConfig", "longrope", {})
    em = ExportLM(hf).eval()
    start, end = LONGROPE_ORIG - 3, LONGROPE_ORIG + 3
    ids = torch.randint(0, 64, (1, end), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids[:, :start], use_cache=True)
        cache, ref = out.past_key_values, []
        for t in range(start, end):
            step = hf(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            ref.append(step.logits)
        o = em(*prefill_inputs(ids[:, :start]))
        past, got = o[1:], []
        for t in range(start, end):
            o = em(ids[:, t : t + 1], torch.full((1, 1), t), causal_mask(1, t), *past)
            past = o[1:]
            got.append(o[0])
    diff = (torch.cat(got, 1) - torch.cat(ref, 1)).abs().max()
    assert diff <= 1e-4, float(diff)
    with torch.no_grad():  # the one-shot run of the same tokens differs: it rotates every key with the long factors
        assert (hf(ids).logits[:, start:] - torch.cat(ref, 1)).abs().max() > 1e-3


def test_static_cache_wrapper_uses_the_scaled_rope():
    hf, _ = _pair("MixtralConfig", "llama3", {})
    m = StaticCacheLM(ExportLM(hf).eval(), capacity=96)
    ids = torch.randint(0, 64, (1, 80), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(80)[None]
    with torch.no_grad():
        got = m(ids, pos, static_mask(pos, 96), *m.empty_cache())[0]
        ref = hf(ids).logits
    assert (got - ref).abs().max() <= 1e-4


def test_dynamic_ntk_is_refused_with_the_reason():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"config.json: rope_type 'dynamic'.*traced graph"):
        ExportLM(transformers.AutoModelForCausalLM.from_config(cfg))


def test_onnx_graph_switches_longrope_factors_in_onnxruntime(tmp_path):
    """The in-graph longrope switch survives conversion: onnxruntime equals transformers on both sides of it."""
    import numpy as np
    import onnxruntime as ort

    from conftest import save_dense
    from moetool.api import export

    d = save_dense(tmp_path / "d", "llama", **rope_kwargs("longrope"))
    export(d, tmp_path / "o", target="onnx", quant="f32", verify=False)
    s = ort.InferenceSession(str(tmp_path / "o" / "model.onnx"), providers=["CPUExecutionProvider"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    cfg = hf.config
    empty = {
        f"past_key_values.{i}.{k}": np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
        for i in range(cfg.num_hidden_layers)
        for k in ("key", "value")
    }
    for n in (SHORT, LONG):
        ids = torch.randint(4, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((1, n), np.int64)}
        got = s.run(None, feeds | {"position_ids": np.arange(n)[None]} | empty)[0]
        with torch.no_grad():
            ref = hf(ids).logits.numpy()
        assert np.abs(got - ref).max() <= 1e-4, (n, float(np.abs(got - ref).max()))
