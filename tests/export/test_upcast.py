"""Float32 arithmetic over 16-bit weights, one layer at a time: the logits equal a whole float32 model's, and the
layers stay 16-bit between calls."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

from moetool.export.upcast import decoder_layers, float32_layer_by_layer, float32_overhead

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("config", [LlamaConfig(**SHAPE), MixtralConfig(**SHAPE, num_local_experts=4)])
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
def test_layer_by_layer_float32_equals_a_float32_model(tmp_path, config, storage):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(storage).save_pretrained(tmp_path)
    full = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    low = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=storage).eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=storage).eval()
    float32_layer_by_layer(low)
    ids = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        want, got, rounded = (m(ids).logits for m in (full, low, plain))
        again = low(ids).logits
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 1e-5, "float32 arithmetic over exact 16-bit weights is a float32 model"
    assert torch.equal(got, again), "casting a layer back and forth loses nothing"
    assert (rounded.float() - want).abs().max() > 10 * (got - want).abs().max(), "16-bit arithmetic rounds"
    assert {p.dtype for p in decoder_layers(low).parameters()} == {storage}, "layers are held in 16 bits"
    assert low.get_input_embeddings().weight is low.get_output_embeddings().weight, "the tied head stays tied"


def test_a_model_without_a_layer_stack_is_refused():
    with pytest.raises(ValueError, match="no stack of layers"):
        decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("tied", [True, False])
def test_the_memory_estimate_counts_what_the_upcast_adds(tied):
    config = MixtralConfig(**(SHAPE | {"tie_word_embeddings": tied}), num_local_experts=4)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    layers = decoder_layers(model)
    one_layer = sum(p.numel() for p in layers[0].parameters())
    float32_layer_by_layer(model)
    outside = sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)
    added = outside * 2 + one_layer * 4  # float32 outside the layers instead of bf16, one layer's float32 copy
    assert float32_overhead(params, config.to_dict()) == pytest.approx(added, rel=0.02)


def test_a_float32_model_is_left_as_it_is():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE))
    float32_layer_by_layer(model)
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in decoder_layers(model))
