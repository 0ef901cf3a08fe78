"""A streamed layer's feed-forward block runs a slice of positions at a time: the same logits, the same routing."""

from __future__ import annotations

import pytest
import torch
from consumer_fixtures import MOE_CASES as CASES
from consumer_fixtures import merge
from transformers import AutoModelForCausalLM

from moetool.compute.rows import feed_forward, rows_of, run_in_rows
from moetool.compute.stream import streamed_causal_lm
from moetool.compute.upcast import decoder_layers
from moetool.errors import MoetoolError
from moetool.routing.tap import RouterTap


@pytest.mark.parametrize("case", list(CASES))
def test_sliced_feed_forward_gives_the_whole_batchs_logits_and_routing(case, tiny_models, tmp_path):
    family, extra = CASES[case]
    moe = merge(tmp_path, tiny_models(family), case, extra)
    ids = torch.randint(0, 200, (3, 40), generator=torch.Generator().manual_seed(1))
    keep = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(2)) > 0.3  # e.g. padding left out
    resident = AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32).eval()
    streamed = streamed_causal_lm(moe, ff_rows=7)  # 120 positions in 18 slices, the last one short
    seen: list[int] = []
    for router in RouterTap.find_routers(streamed):  # called once per slice (the block's own hooks, once per call)
        router.register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[:-1].numel()))
    taps = RouterTap(resident), RouterTap(streamed)
    for tap in taps:
        tap.keep = keep
    with torch.inference_mode():
        want, got = resident(input_ids=ids).logits, streamed(input_ids=ids).logits
    assert max(seen) == 7 and len(seen) == 18 * len(decoder_layers(streamed))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    whole, sliced = (t.logits for t in taps)
    assert len(sliced) == len(whole) == len(taps[1].routers)  # one entry per layer and call, as resident
    for w, s in zip(whole, sliced, strict=True):
        assert s.shape == (int(keep.sum()), w.shape[-1])
        torch.testing.assert_close(s, w.reshape(s.shape), atol=2e-5, rtol=1e-5)
    assert all(rows_of(feed_forward(layer)) is None for layer in decoder_layers(streamed))


def test_a_block_that_returns_more_than_its_positions_is_refused_by_name():
    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    block = Pair()
    run_in_rows(block, 4)
    assert block(torch.ones(1, 4, 2))[0].shape == (1, 4, 2)  # a whole input runs as it always did
    with pytest.raises(MoetoolError, match="Pair returned tuple, not one tensor of its 4 positions"):
        block(torch.ones(2, 5, 2))
    assert rows_of(block) is None


def test_a_per_position_input_is_sliced_with_the_positions():
    class Routed(torch.nn.Module):  # GEM's MLP: a route per position beside the hidden states
        def forward(self, x: torch.Tensor, route: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return x * route.unsqueeze(-1) * scale

    x = torch.randn(3, 5, 4)
    route = torch.arange(15.0).reshape(3, 5)
    want = Routed()(x, route, scale=2.0)
    block = Routed()
    run_in_rows(block, 4)
    torch.testing.assert_close(block(x, route, scale=2.0), want, rtol=0, atol=0)
