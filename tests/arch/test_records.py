"""The architecture records: one place for every fact about a model type, read by the recipe and every exporter."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from moetool.arch.facts import LLAMA_CPP_ARCHS
from moetool.arch.families import FAMILIES
from moetool.arch.outputs import OUTPUT_ARCHS, MoEArch
from moetool.arch.records import MODEL_RECORDS, graph_model_types, model_record, moe_gguf_tensors
from moetool.export.gguf.names import gguf_name, split_names

SRC = Path(__file__).resolve().parents[2] / "src" / "moetool"

# String constants outside moetool/arch that equal a model type or a llama.cpp architecture name but mean something
# else: the `llama` pip extra (llama-cpp-python), GGUF tokenizer model names and llama.cpp pre-tokenizer names.
NOT_MODEL_TYPES = {
    ("extras.py", "llama"),
    ("cli/build.py", "llama"),
    ("export/gguf/exporter.py", "llama"),
    ("export/gguf/verify.py", "llama"),
    ("export/gguf/ggml.py", "llama"),
    ("export/gguf/tokenizer.py", "llama"),
    ("export/gguf/pretokenizers.py", "qwen2"),
}


def _strings(path: Path) -> set[str]:
    return {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_no_module_outside_arch_names_a_model_type() -> None:
    """Adding an architecture touches arch/ only: nothing else may branch on, or map from, a model-type string."""
    names = set(MODEL_RECORDS) | set(LLAMA_CPP_ARCHS)
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("arch/"):
            continue
        found += [(rel, s) for s in sorted(_strings(path) & names) if (rel, s) not in NOT_MODEL_TYPES]
    assert not found, f"model-type strings outside moetool/arch (read the record instead): {found}"


def test_the_allowlist_is_not_stale() -> None:
    for rel, s in NOT_MODEL_TYPES:
        assert s in _strings(SRC / rel), f"{rel} no longer uses {s!r}: drop it from NOT_MODEL_TYPES"


def test_every_record_is_consistent() -> None:
    for mt, rec in MODEL_RECORDS.items():
        assert rec.model_type == mt
        assert rec.gguf_arch in LLAMA_CPP_ARCHS, mt
        assert rec.genai_type in ("llama", "mistral", "qwen2", "qwen3"), mt  # onnxruntime-genai's decoder types
        import transformers

        assert hasattr(transformers, rec.config_class), rec.config_class
    for arch in OUTPUT_ARCHS.values():
        assert arch.gguf.renormalises_topk is not None, f"{arch.name}: an MoE needs llama.cpp's top-k rule"
        assert set(arch.accepts) <= set(FAMILIES), arch.name
        unshared = arch.gguf_unshared
        assert unshared is None or unshared.renormalises_topk is not None


@pytest.mark.parametrize("arch", list(OUTPUT_ARCHS.values()), ids=list(OUTPUT_ARCHS))
def test_gguf_names_come_from_the_record_templates(arch: MoEArch) -> None:
    """Router, expert and shared-expert tensors get llama.cpp's names through the record's own templates."""
    assert gguf_name(arch.router_name(3)) == ("blk.3.ffn_gate_inp.weight", None)
    if arch.expert:
        for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            assert gguf_name(arch.expert_name(3, 5, proj)) == (f"blk.3.ffn_{short}_exps.weight", 5)
    for template, projs in arch.stacked:
        name = template.format(layer=3)
        if len(projs) > 1:
            assert split_names(name) == tuple(f"blk.3.ffn_{p.removesuffix('_proj')}_exps.weight" for p in projs)
        else:
            assert gguf_name(name) == (f"blk.3.ffn_{projs[0].removesuffix('_proj')}_exps.weight", None)
    if arch.shared and arch.shared_gate:
        assert gguf_name(arch.shared.format(layer=1, proj="up_proj")) == ("blk.1.ffn_up_shexp.weight", None)
        assert gguf_name(arch.shared_gate.format(layer=1)) == ("blk.1.ffn_gate_inp_shexp.weight", None)
    rules, splits = moe_gguf_tensors(arch)
    assert rules and all("{i}" in gguf for _, gguf in rules)
    assert all(len(parts) > 1 for _, parts in splits)


def test_topk_rule_reads_the_config_only_where_the_class_has_the_switch() -> None:
    mixtral, qwen2 = OUTPUT_ARCHS["mixtral"], OUTPUT_ARCHS["qwen2_moe"]
    assert mixtral.normalises_topk({"norm_topk_prob": False})  # Mixtral has no switch: always renormalised
    assert not qwen2.normalises_topk({"norm_topk_prob": False})
    assert qwen2.normalises_topk({})  # moetool writes the key; a missing one counts as its default


def test_lookups() -> None:
    assert model_record("olmo") is None
    assert "granitemoe" not in graph_model_types() and "mixtral" in graph_model_types("onnx")


def test_recipe_allows_exactly_the_records(tmp_path: Path) -> None:
    from moetool.recipe.mofe import MoFERecipe

    base = {"name": "x", "method": "mofe", "base_model": "b", "experts": [{"name": "a", "source": "s"}]}
    base |= {"gate_mode": "random", "experts_per_token": 1}
    for name in ("auto", *OUTPUT_ARCHS):
        assert MoFERecipe.model_validate(base | {"architecture": name}).architecture == name
    with pytest.raises(ValueError, match="Input should be 'auto', 'mixtral'"):
        MoFERecipe.model_validate(base | {"architecture": "switch"})
    schema = MoFERecipe.model_json_schema()["properties"]["architecture"]
    assert schema["enum"] == ["auto", *OUTPUT_ARCHS]
