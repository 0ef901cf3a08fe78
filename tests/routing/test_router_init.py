"""Router initialisation: hidden gates equal an independent reference; cheap_embed and random behave."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import write_recipe
from moetool.api import assemble
from moetool.routing.init import cheap_embed_gates, random_gates

POS = {"a": ["def main():", "import os, sys"], "b": ["Permission is hereby granted", "free of charge"]}
NEG = {"a": ["acute bronchitis"], "b": []}


def _reference_rows(base_path, prompts_pos, prompts_neg):
    """Mean over content tokens (not BOS, not padding) of post_attention_layernorm outputs, per prompt, then
    averaged over prompts; positive minus negative; L2-normalised. One prompt at a time, no padding involved."""
    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(base_path))
    outs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.post_attention_layernorm.register_forward_hook(lambda _m, _i, o, li=li: outs.__setitem__(li, o.detach()))
        for li, layer in enumerate(model.model.layers)
    ]

    def mean(prompts):
        acc = torch.zeros(len(model.model.layers), model.config.hidden_size)
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            keep = enc["input_ids"][0] != tok.bos_token_id
            with torch.no_grad():
                model(**enc)
            for li in outs:
                acc[li] += outs[li][0][keep].mean(0)
        return acc / len(prompts)

    v = mean(prompts_pos)
    if prompts_neg:
        v = v - mean(prompts_neg)
    for h in hooks:
        h.remove()
    return v / v.norm(dim=-1, keepdim=True)


def test_hidden_gate_rows_match_hook_reference(tiny_models, tmp_path):
    m = tiny_models("llama")

    def fmt(xs):
        return "[" + ", ".join(repr(x) for x in xs) + "]"

    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
name: hidden
method: mofe
base_model: {m["base"]}
gate_mode: hidden
experts:
  - {{name: a, source: {m["e1"]}, positive_prompts: {fmt(POS["a"])}, negative_prompts: {fmt(NEG["a"])}}}
  - {{name: b, source: {m["e2"]}, positive_prompts: {fmt(POS["b"])}}}
""",
    )
    out = assemble(recipe, tmp_path / "moe")
    weights = load_file(str(out / "model.safetensors"))
    ref = {e: _reference_rows(m["base"], POS[e], NEG[e]) for e in ("a", "b")}
    for layer in range(2):
        router = weights[f"model.layers.{layer}.block_sparse_moe.gate.weight"]
        assert router.shape == (2, 32)
        torch.testing.assert_close(router[0], ref["a"][layer], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(router[1], ref["b"][layer], atol=1e-5, rtol=1e-4)
    # the two experts' rows differ, so the router can tell them apart
    assert (
        weights["model.layers.0.block_sparse_moe.gate.weight"][0]
        - weights["model.layers.0.block_sparse_moe.gate.weight"][1]
    ).abs().max() > 1e-3


def test_cheap_embed_is_mean_token_embedding(tiny_models):
    m = tiny_models("llama")
    tok = AutoTokenizer.from_pretrained(str(m["base"]))
    embed = torch.randn(320, 32)
    gates = cheap_embed_gates(embed, tok, [(["import os"], [])], num_layers=3)
    ids = tok("import os")["input_ids"][1:]  # without BOS
    ref = embed[ids].mean(0)
    assert gates.shape == (3, 1, 32)
    torch.testing.assert_close(gates[2, 0], ref / ref.norm())


def test_random_gates_are_seeded():
    a, b, c = random_gates(2, 3, 16, seed=1), random_gates(2, 3, 16, seed=1), random_gates(2, 3, 16, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_chat_template_prompts_exclude_template_tokens(tiny_models):
    import pytest

    from moetool.routing.init import encode_prompts

    m = tiny_models("llama")
    tok = AutoTokenizer.from_pretrained(str(m["base"]))
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(tok, ["hi"], chat_template=True)
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    enc = encode_prompts(tok, ["import os", "def main():"], chat_template=True)
    ids, content = enc["input_ids"], enc["content_mask"]
    assert ids[0, 0] == tok.bos_token_id and not content[0, 0]
    for row in range(2):
        kept = ids[row][content[row]]
        assert tok.bos_token_id not in kept and tok.eos_token_id not in kept and tok.pad_token_id not in kept
    assert tok.decode(ids[0][content[0]]) == "import os"
