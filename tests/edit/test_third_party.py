"""`moetool experts` on MoE folders moetool did not write: transformers' own save of each output architecture
(random weights, no moetool.json, no tokenizer), edited by index; and an expert that receives no routing mass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TEXT, VOCAB, make_tokenizer
from moetool import api
from moetool.edit.layout import EditError, read_layout
from moetool.edit.parity import logits, probe_ids

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)
# name: (config class, keys)
ARCHS = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 16},
    ),
    "qwen2_moe-dense-layer": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 16, "mlp_only_layers": [0]},
    ),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 48, "head_dim": 8}),
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4}),
}


def third_party(out: Path, arch: str, *, seed: int = 0, tokenizer: bool = True, **kw: object) -> Path:
    import transformers

    cls, keys = ARCHS[arch]
    cfg = getattr(transformers, cls)(**(COMMON | keys | kw))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(str(out))
    if tokenizer:
        make_tokenizer(out)
    return out


@pytest.fixture(scope="module", params=list(ARCHS))
def folder(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, third_party(tmp_path_factory.mktemp(request.param) / "moe", request.param)


def test_every_edit_on_a_third_party_folder(folder, tmp_path):
    arch, moe = folder
    layout = read_layout(moe)
    assert layout.names == ("0", "1", "2", "3") and layout.meta == {}
    assert layout.moe_layers == ((1,) if arch.endswith("dense-layer") else (0, 1))
    text = tmp_path / "calib.txt"
    text.write_text(TEXT * 4)
    listing = api.experts.listing(moe, {"calib": str(text)}, max_tokens=512)
    assert set(listing["routing"]["layers"]) == {str(x) for x in layout.moe_layers}
    removed = api.experts.remove(moe, ["3", "0"], tmp_path / "rm")
    assert read_layout(removed.output).names == ("1", "2")
    assert removed.parity["vs_input_restricted"] <= 1e-5
    for by in ("reap", "frequency", "random"):
        pruned = api.experts.prune(moe, tmp_path / by, keep=0.5, by=by, data={"calib": str(text)}, per_layer=True)
        assert pruned.parity["vs_input_restricted"] <= 1e-5
        layers = json.loads((pruned.output / "moetool.json").read_text())["edits"][0]["layers"]
        assert [len(row["kept"]) for row in layers] == [2] * len(layout.moe_layers)
    extracted = api.experts.extract(moe, "2", tmp_path / "dense")
    assert extracted.parity["vs_input_one_expert"] <= 1e-4
    cfg = json.loads((extracted.output / "config.json").read_text())
    assert cfg["model_type"] == layout.arch.dense_family(layout.config)


def test_adding_a_dense_model_to_a_third_party_moe(tmp_path):
    """The dense source is the MoE's own expert 1, saved as a llama model with the MoE's attention."""
    from transformers import AutoModelForCausalLM

    moe = third_party(tmp_path / "moe", "mixtral")
    dense = api.experts.extract(moe, "1", tmp_path / "dense").output
    added = api.experts.add(moe, dense, tmp_path / "added", name="again", prompts=["def main():"])
    assert added.parity["old_experts_vs_input"] <= 1e-5 and added.parity["new_expert_vs_source"] < 1e-4
    assert read_layout(added.output).names == ("0", "1", "2", "3", "again")
    AutoModelForCausalLM.from_pretrained(str(added.output))


def test_removing_an_expert_no_token_reaches_leaves_logits_unchanged(tmp_path):
    """Top-1 routing with router rows w, −w, 0.01·w: expert 2's logit is never the largest, so no token is routed to
    it, and removing it changes nothing."""
    from safetensors.torch import load_file, save_file

    moe = third_party(tmp_path / "moe", "mixtral", num_local_experts=3, num_experts_per_tok=1)
    weights = load_file(str(moe / "model.safetensors"))
    layout = read_layout(moe)
    for layer in layout.moe_layers:
        w = torch.randn(32)
        weights[layout.router(layer)] = torch.stack([w, -w, 0.01 * w])
    save_file(weights, str(moe / "model.safetensors"), metadata={"format": "pt"})
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    shares = api.experts.listing(moe, {"t": str(text)}, max_tokens=512)["routing"]["layers"]
    assert all(layer["share"][2] == 0 for layer in shares.values())
    out = api.experts.remove(moe, ["2"], tmp_path / "rm").output
    ids = probe_ids(moe)
    assert float((logits(out, ids) - logits(moe, ids)).abs().max()) <= 1e-6


def test_not_an_moe_and_a_fused_folder_are_refused(tiny_models, tmp_path):
    with pytest.raises(EditError, match="not an MoE moetool can edit"):
        read_layout(tiny_models("llama")["base"])
    moe = third_party(tmp_path / "moe", "mixtral")
    from safetensors.torch import load_file, save_file

    weights = load_file(str(moe / "model.safetensors"))
    weights["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 96, 32)
    save_file(weights, str(moe / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EditError, match="fused"):
        read_layout(moe)


def test_a_folder_without_a_tokenizer(tmp_path):
    """Edits that read no text work (the parity check feeds seeded ids); those that read text say what is missing."""
    moe = third_party(tmp_path / "moe", "qwen3_moe", tokenizer=False)
    assert api.experts.remove(moe, ["1"], tmp_path / "rm").parity["vs_input_restricted"] <= 1e-5
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    with pytest.raises(EditError, match="has no tokenizer, which calibration on text needs"):
        api.experts.listing(moe, {"t": str(text)})
    with pytest.raises(EditError, match="has no tokenizer, which the new expert's router row"):
        api.experts.add(
            moe, api.experts.extract(moe, "0", tmp_path / "d").output, tmp_path / "a", name="n", prompts=["x"]
        )
