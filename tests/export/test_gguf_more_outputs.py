"""GGUF export of the further MoE outputs, proven in llama.cpp: GraniteMoE (and dense Granite) with its scales."""

from __future__ import annotations

from pathlib import Path

import gguf
import llama_cpp  # noqa: F401  (the dev extra installs it; a missing runtime must fail, not skip)
import numpy as np
import pytest
from safetensors.torch import load_file

from conftest import TEXT, save_dense, write_recipe
from moetool.api import assemble, export
from moetool.export.gguf.exporter import GATES
from moetool.export.gguf.tokenizer import read_vocab
from moetool.export.gguf.verify import compare

PROMPTS = ("def main():", "Permission is hereby granted", "acute bronchitis")
SCALES = {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25, "logits_scaling": 2.5}


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("granite-gguf")
    base = save_dense(root / "base", "granite", **SCALES)
    return {"base": base} | {
        f"e{i}": save_dense(root / f"e{i}", "granite", seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)
    }


def _max_diff(man: dict) -> float:
    p = man["parity"]
    assert p["tokenizer_match"], p["tokenizer_mismatches"]
    assert p["seq_lens"] == [32, 128] and p["top1_agreement"] == 1.0
    return float(max(p["max_abs_logit_diff"].values()))


def _field(reader: gguf.GGUFReader, key: str) -> float:
    return float(reader.fields[key].parts[-1][0])


@pytest.fixture(scope="module")
def granitemoe(granite, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("granitemoe")
    experts = "\n".join(
        f"  - {{name: x{i}, source: {granite[f'e{i}']}, positive_prompts: [{p!r}]}}"
        for i, p in zip((1, 2, 3), PROMPTS, strict=True)
    )
    recipe = write_recipe(
        tmp / "r.yaml",
        f"name: gm\nmethod: mofe\nbase_model: {granite['base']}\nexperts_per_token: 2\nexperts:\n{experts}\n",
    )
    return assemble(recipe, tmp / "moe")


def test_granitemoe_three_experts_f32(granitemoe, tmp_path):
    moe = granitemoe
    man = export(moe, tmp_path / "f32", quant="f32")
    assert man["llama_cpp_arch"] == "granitemoe"
    assert _max_diff(man) <= 1e-3
    reader = gguf.GGUFReader(str(tmp_path / "f32" / man["file"]))
    assert {k: _field(reader, f"granitemoe.{g}") for k, g in zip(SCALES, _GGUF_SCALES, strict=True)} == SCALES
    assert int(_field(reader, "granitemoe.expert_count")) == 3
    tensors = {t.name: t for t in reader.tensors}
    fused = load_file(next(moe.glob("*.safetensors")))["model.layers.1.block_sparse_moe.input_linear.weight"]
    gate, up = tensors["blk.1.ffn_gate_exps.weight"], tensors["blk.1.ffn_up_exps.weight"]
    assert list(gate.shape) == [32, 48, 3]  # ne order: hidden, ff, experts
    # the split halves are the stacked [gate; up] rows (Q/K permutation aside, the only reordering)
    np.testing.assert_array_equal(np.asarray(gate.data).reshape(3, 48, 32), fused[:, :48].numpy())
    np.testing.assert_array_equal(np.asarray(up.data).reshape(3, 48, 32), fused[:, 48:].numpy())


_GGUF_SCALES = ("embedding_scale", "residual_scale", "attention.scale", "logit_scale")


def test_granitemoe_q8_0_conversion(granitemoe, tmp_path):
    """Quantized: llama.cpp against transformers on the artifact's own weights, the split halves joined back."""
    man = export(granitemoe, tmp_path / "q8", quant="q8_0")
    conv = man["parity"]["conversion"]
    # llama.cpp's q8_0 matmuls round the activations too (measured: 0.04-0.05 max |Δlogit|, top-1 0.97); halves
    # joined in the wrong order would differ by the whole FFN
    assert conv["top1_agreement"] >= 0.95 and max(conv["max_abs_logit_diff"].values()) <= 0.1
    assert abs(conv["ppl_change"]) < 1e-3


def test_granitemoe_with_attention_bias_and_tied_head(tmp_path):
    base = save_dense(tmp_path / "b", "granite", attention_bias=True, tie_word_embeddings=True, **SCALES)
    e1 = save_dense(tmp_path / "e1", "granite", seed=1, base=base, mlp_noise=0.3)
    text = f"name: gb\nmethod: mofe\nbase_model: {base}\ngate_mode: random\nexperts:\n"
    text += f"  - {{name: a, source: {base}}}\n  - {{name: b, source: {e1}}}\n"
    man = export(assemble(write_recipe(tmp_path / "r.yaml", text), tmp_path / "moe"), tmp_path / "o", quant="f32")
    assert _max_diff(man) <= 1e-3
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "o" / man["file"])).tensors}
    assert "blk.0.attn_q.bias" in names and "output.weight" not in names


def test_dense_granite(granite, tmp_path):
    man = export(granite["base"], tmp_path / "dense", quant="f32")
    assert man["llama_cpp_arch"] == "granite"
    assert _max_diff(man) <= 1e-3


def test_granitemoe_through_llama_cpps_converter(granitemoe, tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py (the installed version's, cached by scripts/llama_converter.py) reads
    the folder moetool writes: its file matches transformers and holds the same tensors as moetool's own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_converter", ROOT / "scripts" / "llama_converter.py")
    assert spec is not None and spec.loader is not None
    lc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lc)
    pre = read_vocab(granitemoe).pre
    theirs = lc.convert(granitemoe, tmp_path / "theirs.gguf", outtype="f32", pre=pre, converter=lc.converter_dir())
    report = compare(theirs, granitemoe, TEXT)
    assert max(report.max_abs_logit_diff.values()) <= GATES["f32"], report.max_abs_logit_diff
    man = export(granitemoe, tmp_path / "own", quant="f32")
    assert lc.tensor_differences(tmp_path / "own" / man["file"], theirs) == []


ROOT = Path(__file__).resolve().parents[2]
