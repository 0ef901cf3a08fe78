"""The HF folder moetool writes, through llama.cpp's own convert_hf_to_gguf.py (from the installed llama-cpp-python's
sdist) and loaded in llama.cpp: logits equal transformers', and the file equals moetool's own GGUF."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import gguf
import llama_cpp  # noqa: F401  (the dev extra installs it; a missing runtime must fail, not skip)
import numpy as np
import pytest

from conftest import TEXT, write_recipe
from moetool.api import assemble, export
from moetool.export import ExportError
from moetool.export.gguf.exporter import GATES
from moetool.export.gguf.tokenizer import read_vocab
from moetool.export.gguf.verify import compare, llama_logits, load_llama, quiet_stderr

ROOT = Path(__file__).resolve().parents[2]


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("llama_converter", ROOT / "scripts" / "llama_converter.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lc = _script()


@pytest.fixture(scope="session")
def converter() -> Path:
    """The converter of the installed llama-cpp-python, fetched from PyPI once into moetool's cache."""
    return Path(lc.converter_dir())


def _merge(tmp: Path, m: dict[str, Path], name: str, extra: str) -> Path:
    experts = "".join(
        f"  - {{name: x{i}, source: {m[f'e{i}']}, positive_prompts: ['{p}']}}\n"
        for i, p in ((1, "def main():"), (2, "Permission is hereby granted"), (3, "acute bronchitis"))
    )
    text = f"name: {name}\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\n{extra}\nexperts:\n{experts}"
    return assemble(write_recipe(tmp / f"{name}.yaml", text), tmp / name)


def _arch(path: Path) -> str:
    field = gguf.GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[-1]).decode()


def _logits(path: Path, ids: list[int]) -> np.ndarray:
    llm = load_llama(path, n_ctx=len(ids))
    try:
        return llama_logits(llm, ids)
    finally:
        with quiet_stderr():
            llm.close()


SHARED = "shared_expert: {{source: {base}, positive_prompts: ['def']}}\nnorm_topk_prob: false\n"
CASES = {
    # name: (dense family, recipe lines, llama.cpp arch of the converter's file)
    "mixtral": ("llama", "", "llama"),
    "qwen2_moe-shared": ("qwen2", SHARED, "qwen2moe"),
    "qwen2_moe-no-shared": ("qwen2", "norm_topk_prob: false\n", "qwen2moe"),
    "qwen3_moe": ("qwen3", "", "qwen3moe"),
    "granitemoe": ("granite", "", "granitemoe"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_converter_file_matches_transformers_and_moetool(case, tiny_models, converter, tmp_path):
    family, extra, arch = CASES[case]
    m = tiny_models(family)
    moe = _merge(tmp_path, m, case.replace("_", "-"), extra.format(base=m["base"]))
    if case == "qwen2_moe-no-shared":  # the null shared expert (arch.outputs) stands in for none
        assert json.loads((moe / "config.json").read_text())["shared_expert_intermediate_size"] == 1
    theirs = lc.convert(moe, tmp_path / "converted.gguf", outtype="f32", pre=read_vocab(moe).pre, converter=converter)
    assert _arch(theirs) == arch
    report = compare(theirs, moe, TEXT)
    assert report.tokenizer_match, report.tokenizer_mismatches
    assert max(report.max_abs_logit_diff.values()) <= GATES["f32"], report.max_abs_logit_diff

    man = export(moe, tmp_path / "own", quant="f32")
    ours = tmp_path / "own" / man["file"]
    assert man["llama_cpp_arch"] == arch
    assert lc.tensor_differences(ours, theirs) == []  # same types, shapes and bytes: the same file for llama.cpp
    ids = [1, *range(10, 74)]
    assert float(np.abs(_logits(ours, ids) - _logits(theirs, ids)).max()) <= GATES["f32"]


def test_unreachable_pypi_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    with pytest.raises(lc.ConverterError, match=r"could not download the llama-cpp-python==0\.3\.36 sdist from PyPI"):
        lc.converter_dir("0.3.36", cache=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-fetched is left to be mistaken for a converter


def test_converter_failure_names_the_folder(converter, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(lc.ConverterError, match="convert_hf_to_gguf.py failed on .*empty"):
        lc.convert(tmp_path / "empty", tmp_path / "x.gguf", converter=converter)


def _qwen2_moe_shapes(cfg: dict[str, Any], shared: int) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes of a Qwen2-MoE in moetool's per-expert layout (no weights)."""
    from moetool.arch.outputs import QWEN2_MOE

    h, v, ff, e = cfg["hidden_size"], cfg["vocab_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    out["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        for proj, rows in (("q", h), ("k", kv), ("v", kv)):
            out |= {p + f"self_attn.{proj}_proj.weight": (rows, h), p + f"self_attn.{proj}_proj.bias": (rows,)}
        out[p + "self_attn.o_proj.weight"] = (h, h)
        out[QWEN2_MOE.router_name(i)] = (e, h)
        for x in range(e):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[QWEN2_MOE.expert_name(i, x, proj)] = (ff, h) if proj != "down_proj" else (h, ff)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[QWEN2_MOE.shared.format(layer=i, proj=proj)] = (shared, h) if proj != "down_proj" else (h, shared)
        out[QWEN2_MOE.shared_gate.format(layer=i)] = (1, h)
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_null_shared_expert_layout(norm):
    """The null shared expert (config-marked) is no shared expert to the GGUF layout: llama.cpp's llama form with
    renormalised top-k, else qwen2moe with its zero column mapped as it is (the converter writes the same)."""
    from moetool.arch.outputs import NULL_SHARED_KEY, NULL_SHARED_WIDTH, QWEN2_MOE, shared_expert_width
    from moetool.export.gguf.layout import plan_layout

    cfg: dict[str, Any] = {
        "model_type": "qwen2_moe",
        "hidden_size": 32,
        "vocab_size": 320,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "moe_intermediate_size": 48,
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "norm_topk_prob": norm,
        "shared_expert_intermediate_size": NULL_SHARED_WIDTH,
        NULL_SHARED_KEY: True,
    }
    tensors = QWEN2_MOE.null_shared(0, 32)
    assert [(n.rsplit(".", 2)[-2], s) for n, s, _ in tensors] == [
        ("gate_proj", (1, 32)),
        ("up_proj", (1, 32)),
        ("down_proj", (32, 1)),
        ("shared_expert_gate", (1, 32)),
    ]
    assert [v for *_, v in tensors][:3] == [0.0] * 3 and tensors[3][2] != 0  # llama.cpp's silu(x)/x is NaN at 0
    assert shared_expert_width(cfg) == 0 and shared_expert_width(cfg | {NULL_SHARED_KEY: False}) == NULL_SHARED_WIDTH
    layout = plan_layout(cfg, _qwen2_moe_shapes(cfg, NULL_SHARED_WIDTH))
    shexp = {t.name: t.shape for t in layout.tensors if "shexp" in t.name}
    if norm:
        assert layout.arch == "llama" and not shexp
    else:
        assert layout.arch == "qwen2moe" and layout.shared_ff == NULL_SHARED_WIDTH
        assert shexp["blk.1.ffn_down_shexp.weight"] == (32, NULL_SHARED_WIDTH)
        assert not any(t.zeros for t in layout.tensors)  # mapped from the folder, not padded
    real = cfg | {NULL_SHARED_KEY: False}  # the same shapes unmarked: a real (if tiny) shared expert
    if norm:
        with pytest.raises(ExportError, match="norm_topk_prob: false"):
            plan_layout(real, _qwen2_moe_shapes(cfg, NULL_SHARED_WIDTH))


def test_converter_scales_the_rope_as_transformers(converter, tmp_path):
    """A Mixtral of a llama3-rope base: the converter reads the top-level rope_scaling the folder carries (the
    released form) and llama.cpp computes what transformers does past the original context (64 tokens)."""
    from consumer_fixtures import merge
    from rope_cases import MAX_POS, ROPES, THETA

    from conftest import save_dense

    kw = {"rope_parameters": {"rope_theta": THETA, **ROPES["llama3"]}, "max_position_embeddings": MAX_POS}
    base = save_dense(tmp_path / "base", "llama", **kw)
    experts = {f"e{i}": save_dense(tmp_path / f"e{i}", "llama", seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)}
    moe = merge(tmp_path, {"base": base} | experts, "mixtral")
    theirs = lc.convert(moe, tmp_path / "c.gguf", outtype="f32", pre=read_vocab(moe).pre, converter=converter)
    report = compare(theirs, moe, TEXT * 3)
    assert max(report.max_abs_logit_diff.values()) <= GATES["f32"], report.max_abs_logit_diff
