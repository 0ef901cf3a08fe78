"""A model streamed from disk one decoder layer at a time computes what the resident float32 model computes."""

from __future__ import annotations

import pytest
import torch
from consumer_fixtures import MOE_CASES as CASES
from consumer_fixtures import bf16_copy as _bf16
from consumer_fixtures import merge
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moetool.compute.stream import NonFiniteModel, stream_of, streamed_causal_lm, streamed_weight_bytes
from moetool.compute.upcast import decoder_layers, precision_of


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_logits_equal_the_resident_float32_model(case, tiny_models, tmp_path):
    family, extra = CASES[case]
    moe = _bf16(merge(tmp_path, tiny_models(family), case, extra))
    ids = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    resident = AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32).eval()
    streamed = streamed_causal_lm(moe, storage=torch.bfloat16)
    with torch.inference_mode():
        want, want_short = resident(input_ids=ids).logits, resident(input_ids=ids[:1, :16]).logits
        got = streamed(input_ids=ids).logits
        again = streamed(input_ids=ids[:1, :16]).logits  # every layer read again, at another length
    # the same float32 values in the same kernels: exact, not merely close
    assert torch.equal(got, want)
    assert torch.equal(again, want_short)
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
def test_the_streamed_estimate_reads_a_layer_in_place_for_every_output_architecture(case, tiny_models, tmp_path):
    """Every output architecture's layer is read straight into its parameters, so the estimate holds one float32
    layer and the largest tensor being read, not the half layer more that transformers' own loading would need."""
    import json

    from moetool.compute.upcast import layer_bytes
    from moetool.io.checkpoint import Checkpoint

    family, extra = CASES[case]
    moe = _bf16(merge(tmp_path, tiny_models(family), case, extra))
    config = json.loads((moe / "config.json").read_text())
    ck = Checkpoint(moe)
    params = sum(t.numel for t in ck.tensors.values())
    largest = max(t.numel * 2 for n, t in ck.tensors.items() if n.startswith("model.layers.0."))
    outside, layer = layer_bytes(config, params)
    assert streamed_weight_bytes(config, params, moe) == outside + layer + largest
    assert streamed_weight_bytes(config, params) == outside + layer * 3 // 2  # without the checkpoint: the margin
    (moe / "config.json").write_text(json.dumps(config | {"model_type": "not_a_model"}))
    assert streamed_weight_bytes(config, params, moe) == outside + layer * 3 // 2  # cannot be built: the margin
