"""Float32 arithmetic over 16-bit weights, one layer at a time: the logits equal a whole float32 model's, and the
layers stay 16-bit between calls."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2MoeConfig

from moetool.compute.upcast import Float32Arithmetic, decoder_layers, float32_layer_by_layer, float32_overhead

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


def _tuning_pair(tmp_path, config):
    """The same weights twice (bf16-exact): a bf16 model with float32 trainable weights and float32 arithmetic, and
    a float32 model; both with the experts frozen, as router tuning holds them."""
    from moetool.train.freeze import apply_freeze
    from moetool.train.precision import keep_trainable_float32

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    low = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    full = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for m in (low, full):
        apply_freeze(m, "mofe")
        m.train()
    keep_trainable_float32(low)
    return low, full


@pytest.mark.parametrize(
    "config",
    [
        MixtralConfig(**SHAPE, num_local_experts=4),
        Qwen2MoeConfig(**SHAPE, num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=80),
    ],
    ids=["mixtral", "qwen2-moe-shared-expert"],
)
def test_training_over_16bit_weights_gives_a_float32_models_gradients(tmp_path, config, monkeypatch):
    low, full = _tuning_pair(tmp_path, config)
    arith = Float32Arithmetic(low)
    packed: list[tuple[bool, object]] = []  # (was a live float32 upcast, what autograd kept)
    real_pack = arith._pack

    def pack(t):
        out = real_pack(t)
        packed.append((t.untyped_storage().data_ptr() in arith._live, out))
        return out

    monkeypatch.setattr(arith, "_pack", pack)
    ids = torch.randint(0, 300, (2, 24))
    with arith.saving():
        loss = low(input_ids=ids, labels=ids).loss
    upcast = [out for live, out in packed if live]
    assert upcast, "the frozen 16-bit experts were upcast and saved for the backward pass"
    assert all(isinstance(out, tuple) and out[0].dtype == torch.bfloat16 for out in upcast), (
        "what autograd keeps of an upcast is its 16-bit source, never the float32 copy"
    )
    assert not arith._live, "no upcast outlives its layer's forward"
    loss.backward()
    want = full(input_ids=ids, labels=ids).loss
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-5
    grads = {n: p.grad for n, p in full.named_parameters() if p.requires_grad}
    for n, p in low.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32 and p.grad is not None
            assert (p.grad - grads[n]).abs().max() <= 1e-4 * grads[n].abs().max() + 1e-7, n
        else:
            assert p.grad is None
    assert {p.dtype for n, p in low.named_parameters() if ".experts." in n} == {torch.bfloat16}, "experts stay 16-bit"
    arith.remove()
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in arith.layers)


def test_trainable_16bit_weights_are_refused_where_a_gradient_is_recorded():
    model = AutoModelForCausalLM.from_config(MixtralConfig(**SHAPE, num_local_experts=4)).to(torch.bfloat16)
    Float32Arithmetic(model)
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        assert model(ids).logits.dtype == torch.float32, "inference needs no gradient: nothing to refuse"
    with pytest.raises(ValueError, match="trainable 16-bit parameter"):
        model(ids)
