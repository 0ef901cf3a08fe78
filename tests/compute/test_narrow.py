"""A streamed model holds its expert stacks, embedding and head as stored (bf16) and still computes in float32."""

from __future__ import annotations

import pytest
import torch
from consumer_fixtures import MOE_CASES as CASES
from consumer_fixtures import bf16_copy as _bf16
from consumer_fixtures import merge

from moetool.compute.narrow import expert_stacks
from moetool.compute.stream import streamed_causal_lm
from moetool.compute.upcast import decoder_layers


@pytest.mark.parametrize("case", list(CASES))
def test_stacks_embedding_and_head_stay_bf16_while_the_arithmetic_is_float32(case, tiny_models, tmp_path):
    family, extra = CASES[case]
    moe = _bf16(merge(tmp_path, tiny_models(family), case, extra))
    model = streamed_causal_lm(moe)
    stacks = expert_stacks(model)
    assert stacks, "every output architecture's experts are stacks"
    dtypes: list[dict[str, torch.dtype]] = []
    for layer in decoder_layers(model):  # after the stream's own pre-hook: the layer is read
        layer.register_forward_pre_hook(lambda m, _a: dtypes.append({n: p.dtype for n, p in m.named_parameters()}))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[5, 9, 2, 7]])).logits
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())
    for held in dtypes:
        narrow = {n for n, d in held.items() if d == torch.bfloat16}
        assert narrow and all(n.endswith(("gate_up_proj", "up_proj", "down_proj")) for n in narrow)
        assert all(held[n] == torch.float32 for n in held if "experts" not in n)  # attention, norms, router
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.get_output_embeddings().weight.dtype == torch.bfloat16  # put back after its float32 product


def test_an_expert_matrix_is_upcast_alone(tiny_models, tmp_path):
    """The largest float32 tensor made while the experts run is one expert's matrix, never a stack."""
    moe = _bf16(merge(tmp_path, tiny_models("llama"), "mixtral"))
    model = streamed_causal_lm(moe)
    stack = next(iter(expert_stacks(model).values()))
    made: list[tuple[int, ...]] = []
    real_to = torch.Tensor.to

    def watching(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = real_to(self, *args, **kwargs)
        if self.dtype == torch.bfloat16 and out.dtype == torch.float32:
            made.append(tuple(out.shape))
        return out

    torch.Tensor.to = watching  # type: ignore[method-assign]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([[5, 9, 2, 7, 3, 1]]))
    finally:
        torch.Tensor.to = real_to  # type: ignore[method-assign]
    _experts, rows, cols = stack.gate_up_proj.shape
    assert (rows, cols) in made and all(len(s) == 2 for s in made)  # [2F, D] (and [D, F]), never [E, 2F, D]
