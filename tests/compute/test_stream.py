"""A model streamed from disk one decoder layer at a time computes what the resident float32 model computes."""

from __future__ import annotations

import pytest
import torch
from consumer_fixtures import MOE_CASES as CASES
from consumer_fixtures import bf16_copy as _bf16
from consumer_fixtures import merge
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moetool.compute.stream import NonFiniteModel, stream_of, streamed_causal_lm
from moetool.compute.stream_bytes import streamed_weight_bytes
from moetool.compute.upcast import decoder_layers, precision_of


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_logits_equal_the_resident_float32_model(case, tiny_models, tmp_path):
    family, extra = CASES[case]
    moe = _bf16(merge(tmp_path, tiny_models(family), case, extra))
    ids = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    # the streamed experts run transformers' eager loop, one expert's matrices upcast at a time (compute.narrow)
    resident = AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32, experts_implementation="eager")
    grouped = AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32).eval()  # the default kernel
    streamed = streamed_causal_lm(moe, storage=torch.bfloat16)
    with torch.inference_mode():
        want, want_short = resident.eval()(input_ids=ids).logits, resident(input_ids=ids[:1, :16]).logits
        got = streamed(input_ids=ids).logits
        again = streamed(input_ids=ids[:1, :16]).logits  # every layer read again, at another length
        default = grouped(input_ids=ids).logits
    # the same float32 values in the same kernels: exact, not merely close
    assert torch.equal(got, want)
    assert torch.equal(again, want_short)
    assert (got - default).abs().max() <= 1e-5 * default.abs().max()  # the grouped kernel sums in another order
    layers = decoder_layers(streamed)
    assert all(p.is_meta for p in layers.parameters()), "a layer's weights outlived its forward"
    stream = stream_of(streamed)
    assert stream is not None and stream.passes == 2 and stream.loads == 2 * len(layers)
    assert precision_of(streamed) == (torch.bfloat16, torch.float32)
    assert stream_of(resident) is None


def test_a_non_finite_layer_is_named_when_it_is_read(tiny_models, tmp_path):
    moe = merge(tmp_path, tiny_models("llama"), "mixtral")
    f = next(moe.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(k for k in tensors if k.startswith("model.layers.1.") and k.endswith("self_attn.o_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    model = streamed_causal_lm(moe)  # nothing of layer 1 is read yet
    with torch.inference_mode(), pytest.raises(NonFiniteModel, match=r"model\.layers\.1\.self_attn\.o_proj\.weight"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("case", list(CASES))
def test_the_streamed_estimate_is_what_the_model_holds_for_every_output_architecture(case, tiny_models, tmp_path):
    """The estimate counts the weights as the streamed model holds them, measured while each layer runs: outside
    the layers, the largest layer (expert stacks, embedding and head in bf16, the rest float32), and the most a
    layer adds while read or computed; without a buildable checkpoint, everything in float32 and half a layer more."""
    import json

    from moetool.compute.stream_bytes import held_bytes
    from moetool.compute.upcast import layer_bytes
    from moetool.io.checkpoint import Checkpoint

    family, extra = CASES[case]
    moe = _bf16(merge(tmp_path, tiny_models(family), case, extra))
    model = streamed_causal_lm(moe)
    layers = decoder_layers(model)
    outside = sum(t.nbytes for t in model.state_dict().values() if not t.is_meta)  # before any layer is read
    seen: list[int] = []
    for layer in layers:  # after the stream's own pre-hook: the layer is read
        layer.register_forward_pre_hook(lambda m, _a: seen.append(sum(t.nbytes for t in m.state_dict().values())))
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    held = held_bytes(moe)
    assert held is not None and (held.outside, held.layer) == (outside, max(seen))
    config = json.loads((moe / "config.json").read_text())
    params = sum(t.numel for t in Checkpoint(moe).tensors.values())
    assert streamed_weight_bytes(config, params, moe) == held.peak < params * 4  # below the float32 model
    f32_outside, f32_layer = layer_bytes(config, params)
    assert streamed_weight_bytes(config, params) == f32_outside + f32_layer * 3 // 2  # without the checkpoint
    (moe / "config.json").write_text(json.dumps(config | {"model_type": "not_a_model"}))
    assert streamed_weight_bytes(config, params, moe) == f32_outside + f32_layer * 3 // 2  # cannot be built
