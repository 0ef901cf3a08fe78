"""The tuned model's weights: the input checkpoint's tensors with the tuned ones in their place."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetool.errors import MoetoolError
from moetool.train.output import write_weights


def _checkpoint(d, *, head: bool):
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.0.w1.weight": torch.randn(6, 4, generator=g).bfloat16(),
        "model.layers.0.steps": torch.arange(3),  # an integer tensor keeps its dtype
    }
    if head:  # a tied model written by a tool that stores the head too
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")
    return tensors


@pytest.mark.parametrize("head", [True, False])
def test_tuned_tensors_replace_theirs_and_the_rest_is_copied(tmp_path, head):
    src = _checkpoint(tmp_path / "in", head=head)
    embed = torch.randn(8, 4)  # a tied weight, tuned under both of its names
    tuned = {"model.embed_tokens.weight": embed, "lm_head.weight": embed}
    (tmp_path / "out").mkdir()
    write_weights(tmp_path / "in", tmp_path / "out", tuned, torch.bfloat16)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(src)
    assert got["model.embed_tokens.weight"].equal(embed.bfloat16())
    if head:  # the stored head follows the tuned embedding, never the stale input
        assert got["lm_head.weight"].equal(embed.bfloat16())
    assert got["model.layers.0.mlp.experts.0.w1.weight"].equal(src["model.layers.0.mlp.experts.0.w1.weight"])
    assert got["model.layers.0.steps"].equal(src["model.layers.0.steps"])


def test_a_tuned_tensor_the_checkpoint_does_not_hold_is_an_error(tmp_path):
    _checkpoint(tmp_path / "in", head=False)
    (tmp_path / "out").mkdir()
    with pytest.raises(MoetoolError, match="the tuned tensor model.norm.weight is not in the checkpoint"):
        write_weights(tmp_path / "in", tmp_path / "out", {"model.norm.weight": torch.ones(4)}, torch.bfloat16)
