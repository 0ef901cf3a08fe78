"""The merged folder computes the same in every consumer that runs here: its config in the form the families'
releases use (top-level ``rope_theta``/``rope_scaling``, the family's expert-count key), loaded by mlx-lm and
compared with transformers float32 at two lengths; top-k defaults every consumer computes alike, and a warning naming
the consumers that differ when a recipe asks for the other rule. (llama.cpp's converter: test_converter_roundtrip.)"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import pytest
from consumer_fixtures import hf_logits, merge, mlx_logits
from rope_cases import MAX_POS, ROPES, THETA

from conftest import save_dense, write_recipe
from moetool.api import plan
from moetool.arch.consumers import MLX_LM, VLLM, differing
from moetool.arch.outputs import OUTPUT_ARCHS
from moetool.arch.records import converter_caveat
from moetool.arch.released import released_config
from moetool.io.safe import read_json

SHARED = "shared_expert: {{source: {base}, positive_prompts: ['def']}}\n"
# name: (dense family, recipe lines)
CASES: dict[str, tuple[str, str]] = {
    "mixtral": ("llama", ""),
    "mixtral-from-mistral": ("mistral", ""),
    "qwen2_moe-shared": ("qwen2", SHARED),
    "qwen2_moe-no-shared": ("qwen2", ""),
    "qwen3_moe": ("qwen3", ""),
    "granitemoe": ("granite", ""),
}
LENGTHS = (16, 128)  # the tiny configs' max_position_embeddings is 128


@pytest.mark.parametrize("case", list(CASES))
def test_mlx_lm_computes_what_transformers_computes(case, tiny_models, tmp_path):
    family, extra = CASES[case]
    moe = merge(tmp_path, tiny_models(family), case, extra)
    cfg = read_json(moe / "config.json")
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    arch = OUTPUT_ARCHS[case.split("-")[0]]
    assert arch.count_key in cfg and {"num_experts", "num_local_experts"} - {arch.count_key} - set(cfg)
    for n in LENGTHS:
        ids = [1, *range(5, 4 + n)]
        diff = float(np.abs(mlx_logits(moe, ids) - hf_logits(moe, ids)).max())
        assert diff <= 1e-4, f"{case} at {n} tokens: max |Δlogit| {diff}"


@pytest.mark.parametrize("rope", ["llama3", "yarn", "linear"])
@pytest.mark.parametrize(("family", "case"), [("granite", "granitemoe"), ("llama", "mixtral")])
def test_scaled_rope_in_mlx_lm(rope, family, case, tmp_path):
    """``rope_scaling`` beside ``rope_parameters``: mlx-lm's GraniteMoE scales as transformers does; its Mixtral
    ignores the scaling, which the merge says, naming mlx-lm."""
    params = {"rope_theta": THETA, **ROPES[rope]}
    kw: dict[str, Any] = {"rope_parameters": params, "max_position_embeddings": MAX_POS}
    base = save_dense(tmp_path / "base", family, **kw)
    experts = (save_dense(tmp_path / f"e{i}", family, seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3))
    moe = merge(tmp_path, {"base": base} | {f"e{i}": e for i, e in enumerate(experts, 1)}, case)
    cfg = read_json(moe / "config.json")
    assert cfg["rope_scaling"] == {k: v for k, v in cfg["rope_parameters"].items() if k != "rope_theta"}
    warned = [w for w in plan(tmp_path / f"{case}.yaml").warnings if "rope_scaling" in w]
    ids = [1, *range(5, 4 + 299)]
    diff = float(np.abs(mlx_logits(moe, ids) - hf_logits(moe, ids)).max())
    if case == "granitemoe":
        assert diff <= 1e-4 and not warned, f"{rope}: max |Δlogit| {diff}"
    else:
        assert diff > 1e-2 and len(warned) == 1 and "mlx-lm (0.32.2)" in warned[0] and rope in warned[0]


def test_released_keys_load_in_transformers_alike_and_quietly(caplog):
    """transformers 5 reads the legacy keys beside its own without a warning and to the same rope."""
    import transformers

    for arch in OUTPUT_ARCHS.values():
        family = next(iter(arch.accepts))
        dense = getattr(transformers, f"{family.capitalize()}Config")(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
            rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **{k: v for k, v in ROPES["llama3"].items() if k != "rope_type"}},
        )  # fmt: skip
        cfg = arch.make_config(dense, n_experts=4, top_k=2, shared_intermediate=None)
        out = released_config(cfg)
        assert released_config(out) == out  # idempotent: an edit of a merged folder writes the same keys
        assert out["rope_theta"] == 5e5 and out["rope_scaling"]["rope_type"] == "llama3"
        assert out[arch.count_key] == 4
        caplog.clear()
        with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
            warnings.simplefilter("error")
            loaded = getattr(transformers, arch.config_class).from_dict(out)
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        assert loaded.rope_parameters == cfg["rope_parameters"]
        assert released_config({"model_type": "llama", "rope_theta": 1e4}) == {"model_type": "llama", "rope_theta": 1e4}


@pytest.mark.parametrize(
    ("family", "extra", "named"),
    [
        ("qwen2", "", []),  # the default: un-normalised, as every consumer computes it
        ("qwen2", "norm_topk_prob: true\n", ["convert_hf_to_gguf.py", "mlx-lm (0.32.2)", "norm_topk_prob: false"]),
        ("qwen3", "", []),
        ("qwen3", "norm_topk_prob: false\n", ["convert_hf_to_gguf.py"]),
        ("llama", "", []),
    ],
)
def test_default_top_k_rule_is_what_every_consumer_computes(family, extra, named, tmp_path):
    base = save_dense(tmp_path / "base", family)
    experts = "\n".join(f"  - {{name: x{i}, source: {base}}}" for i in range(3))
    text = f"name: c\nmethod: mofe\nbase_model: {base}\nexperts_per_token: 2\ngate_mode: random\n{extra}experts:\n{experts}\n"
    p = plan(write_recipe(tmp_path / "r.yaml", text))
    caveats = [w for w in p.warnings if "routing weights" in w]
    assert bool(caveats) == bool(named), caveats
    for name in named:
        assert name in caveats[0]
    if family == "qwen3" and extra:
        assert "mlx-lm" not in caveats[0] and "vLLM" not in caveats[0]  # both read norm_topk_prob


def test_consumer_rules_cover_every_output_architecture():
    for consumer in (MLX_LM, VLLM):
        assert set(consumer.topk) == {a.model_type for a in OUTPUT_ARCHS.values()}, consumer.name
    qwen2 = {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2}
    assert [c.name for c in differing(qwen2 | {"norm_topk_prob": True}, True)] == ["mlx-lm"]
    assert differing(qwen2 | {"norm_topk_prob": False}, False) == []
    assert converter_caveat(qwen2 | {"norm_topk_prob": False, "shared_expert_intermediate_size": 8}) is None
