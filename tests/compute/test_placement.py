"""A layer read straight into its parameters holds what transformers' own loading gives, bit for bit, for every
output architecture; conversions it does not know are left to transformers."""

from __future__ import annotations

import pytest
import torch
from consumer_fixtures import MOE_CASES as CASES
from consumer_fixtures import bf16_copy as _bf16
from consumer_fixtures import merge
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import Transpose, WeightConverter

from moetool.compute.placement import place
from moetool.compute.stream import meta_causal_lm


def _shapes(moe):
    out = {}
    for f in moe.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out |= {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}  # noqa: SIM118
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_layers_read_in_place_equal_from_pretrained(case, tiny_models, tmp_path):
    family, extra = CASES[case]
    moe = _bf16(merge(tmp_path, tiny_models(family), case, extra))
    want = AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32).state_dict()
    meta = meta_causal_lm(moe, torch.float32)
    meta.load_outside()
    for i in sorted(meta.layer_keys):
        meta.loader.load(meta.layer_keys[i])
    got = meta.model.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name
    placed = place(meta.model, _shapes(moe), meta.loader._conversions, meta.loader._meta)
    experts = [t for t in placed.targets if ".experts." in t]
    if case != "granitemoe":  # transformers' own layout there: nothing to stack
        assert experts and not [k for k in placed.rest if ".experts." in k], placed.rest


def test_an_unknown_conversion_is_left_to_transformers(tiny_models, tmp_path):
    """A converter with an operation the placement does not model (a transpose) leaves its keys to transformers."""
    family, extra = CASES["mixtral"]
    moe = merge(tmp_path, tiny_models(family), "mixtral", extra)
    meta = meta_causal_lm(moe, torch.float32)
    conversions = list(get_model_conversion_mapping(meta.model, None, None))
    for c in conversions:
        if isinstance(c, WeightConverter) and "down_proj" in str(c.target_patterns):
            c.operations = [*c.operations, Transpose(1, 2)]
    placed = place(meta.model, _shapes(moe), conversions, meta.loader._meta)
    assert any(k.endswith("w2.weight") for k in placed.rest)
    assert not any(k.endswith(("w1.weight", "w3.weight")) for k in placed.rest)
    assert not any(t.endswith("down_proj") for t in placed.targets)
