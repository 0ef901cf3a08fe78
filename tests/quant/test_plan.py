"""Quantization plans: roles, rule order, llama.cpp's fallbacks, sizes, --quant syntax, recipe errors."""

from __future__ import annotations

import pytest

from conftest import write_recipe
from moetool.errors import RecipeError
from moetool.quant.plan import QuantSpec, TensorEntry, parse_quant, resolve
from moetool.quant.roles import role_of
from moetool.quant.types import TYPES, fit_type
from moetool.recipe import load_recipe

H, FF, E = 256, 512, 3
ENTRIES = [
    TensorEntry("model.embed_tokens.weight", (1000, H), "token_embd.weight"),
    TensorEntry("model.layers.0.input_layernorm.weight", (H,), "blk.0.attn_norm.weight"),
    TensorEntry("model.layers.0.self_attn.q_proj.weight", (H, H), "blk.0.attn_q.weight"),
    TensorEntry("model.layers.0.self_attn.q_proj.bias", (H,), "blk.0.attn_q.bias"),
    TensorEntry("model.layers.0.block_sparse_moe.gate.weight", (E, H), "blk.0.ffn_gate_inp.weight"),
    TensorEntry("model.layers.0.block_sparse_moe.experts.*.w1.weight", (E, FF, H), "blk.0.ffn_gate_exps.weight"),
    TensorEntry("model.layers.0.block_sparse_moe.experts.*.w2.weight", (E, H, FF), "blk.0.ffn_down_exps.weight"),
    TensorEntry("model.layers.0.mlp.shared_expert.up_proj.weight", (FF, H), "blk.0.ffn_up_shexp.weight"),
    TensorEntry("model.layers.0.mlp.shared_expert_gate.weight", (1, H), "blk.0.ffn_gate_inp_shexp.weight"),
    TensorEntry("lm_head.weight", (1000, H), "output.weight"),
]


def test_roles():
    roles = [role_of(e.hf_name) for e in ENTRIES]
    assert roles == [
        "embeddings",
        "norms",
        "attention",
        "attention",
        "router",
        "experts",
        "experts",
        "shared_expert",
        "router",
        "output",
    ]
    assert role_of("model.layers.2.mlp.down_proj.weight") == "ffn"
    assert role_of("model.layers.2.self_attn.k_norm.weight") == "norms"
    with pytest.raises(ValueError, match="cannot tell the role"):
        role_of("model.vision_tower.patch.weight")


def test_sizes_match_ggml_block_layout():
    assert TYPES["q4_0"].nbytes((32, 64)) == 32 * 2 * 18
    assert TYPES["q8_0"].bpw == 8.5 and TYPES["q4_k"].bpw == 4.5 and TYPES["q6_k"].bpw == 6.5625
    assert TYPES["f16"].nbytes((3, 5)) == 30


def test_gem_preset_roles_and_fallbacks():
    plan = resolve(QuantSpec(preset="gem"), ENTRIES)
    t = {a.entry.out_name: a.type for a in plan.assignments}
    assert t["blk.0.ffn_gate_exps.weight"] == "q4_k"  # rows of 256: K type usable
    assert t["blk.0.ffn_down_exps.weight"] == "q4_k"  # rows of 512
    assert t["blk.0.ffn_gate_inp.weight"] == "q6_k"
    assert t["blk.0.attn_q.weight"] == "q8_0" and t["token_embd.weight"] == "q8_0"
    assert t["blk.0.attn_norm.weight"] == "f32" and t["blk.0.attn_q.bias"] == "f32"
    # rows of 128 cannot hold a 256-block: llama.cpp's fallback table decides
    small = resolve(
        QuantSpec(preset="gem"), [TensorEntry("model.layers.0.block_sparse_moe.experts.*.w1.weight", (3, 384, 128))]
    )
    assert small.assignments[0].type == "q5_0" and small.assignments[0].requested == "q4_k"
    assert any("q4_k → q5_0" in n for n in small.notes())


def test_first_matching_rule_wins_and_globs_see_both_names():
    spec = parse_quant("blk.0.ffn_gate_exps.*=q8_0,experts=q4_0,model.embed_tokens.*=f16,*=q5_0")
    plan = resolve(spec, ENTRIES)
    t = {a.entry.out_name: a.type for a in plan.assignments}
    assert t["blk.0.ffn_gate_exps.weight"] == "q8_0"
    assert t["blk.0.ffn_down_exps.weight"] == "q4_0"
    assert t["token_embd.weight"] == "f16"  # matched through its HF name
    assert t["blk.0.attn_q.weight"] == "q5_0"


def test_bytes_by_role_add_up():
    plan = resolve(parse_quant("moe-q4"), ENTRIES)
    by_role = plan.by_role()
    assert sum(r["bytes"] for r in by_role.values()) == plan.total_bytes
    assert by_role["experts"]["bytes"] == TYPES["q4_0"].nbytes((E, FF, H)) + TYPES["q4_0"].nbytes((E, H, FF))
    assert by_role["router"]["types"] == {"f32": 2}
    assert plan.to_json()["tensors"]["blk.0.ffn_gate_exps.weight"]["type"] == "q4_0"


def test_uniform_type_keeps_router_f32_and_cannot_swaps():
    plan = resolve(parse_quant("q4_k"), ENTRIES, cannot={"router:q6_k": "q8_0"})
    assert plan.type_of("blk.0.ffn_gate_inp.weight") == "f32"
    gem = resolve(parse_quant("gem"), ENTRIES, cannot={"router:q6_k": "q8_0"})
    assert gem.type_of("blk.0.ffn_gate_inp.weight") == "q8_0"


def test_fit_type():
    assert fit_type("q6_k", 512) == ("q6_k", None)
    assert fit_type("q6_k", 128)[0] == "q8_0"
    assert fit_type("q4_0", 48)[0] == "f16"  # not even a 32-block


@pytest.mark.parametrize(
    "text, message",
    [("q9_9", "unknown preset"), ("experts=q3", "unknown precision"), ("experts=", "no type")],
)
def test_bad_quant_flag(text, message):
    with pytest.raises(ValueError, match=message):
        parse_quant(text)


def test_recipe_quantization_section_errors_name_the_line(tmp_path, tiny_models):
    m = tiny_models("llama")
    body = f"""name: q
method: mofe
base_model: {m["base"]}
gate_mode: random
experts_per_token: 1
experts:
  - {{name: a, source: {m["e1"]}}}
quantization:
  default: q8_0
  rules:
    - {{role: experts, type: q4_k}}
    - {{role: expertz, type: q4_0}}
"""
    with pytest.raises(RecipeError, match=r"r.yaml:12: quantization.rules.1.role"):
        load_recipe(write_recipe(tmp_path / "r.yaml", body))
    ok = load_recipe(write_recipe(tmp_path / "ok.yaml", body.replace("expertz", "attention")))
    assert ok.quantization.effective()[0] == "q8_0"


def test_a_rule_that_matches_no_tensor_is_an_error_naming_it():
    """A typo in a glob used to leave every tensor at the default (f32: twice the planned size), silently."""
    from moetool.quant.plan import UnmatchedRuleError

    with pytest.raises(UnmatchedRuleError, match=r"rule 'blk\.0\.ffn_gate_expz\*=q4_0' matches no tensor"):
        resolve(parse_quant("blk.0.ffn_gate_expz*=q4_0,*=q8_0"), ENTRIES)
    dense = [e for e in ENTRIES if "shared" not in e.hf_name]
    with pytest.raises(UnmatchedRuleError, match="'shared_expert=q8_0' matches no tensor"):
        resolve(parse_quant("shared_expert=q8_0,*=q4_0"), dense)
    resolve(parse_quant("moe-q4"), dense)  # a preset's rules need not all apply
    resolve(parse_quant("blk.0.ffn_gate_exps*=q4_0,*=q8_0"), ENTRIES)
