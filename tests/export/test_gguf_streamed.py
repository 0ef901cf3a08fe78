"""GGUF verification of a model whose 16-bit copy does not fit: both transformers models stream from disk."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from tuning_fixtures import write_tuning_recipe

from conftest import save_dense
from moetool.api import assemble, export
from moetool.compute.upcast import float32_overhead, layer_bytes
from moetool.export.gguf import exporter as gguf_exporter
from moetool.export.reference import VERIFY_OVERHEAD, streamed_need
from moetool.io.checkpoint import Checkpoint


def test_verification_streams_when_the_16bit_model_does_not_fit_with_the_resident_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    # deep and narrow, as real models are: one layer is a small part of the whole
    root = tmp_path / "deep"
    base = save_dense(root / "base", num_hidden_layers=8, tie_word_embeddings=True)
    family = {"base": base} | {f"e{i}": save_dense(root / f"e{i}", seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)}
    recipe = write_tuning_recipe(root, family, steps=1)
    recipe.write_text(recipe.read_text().replace("gate_mode: random\n", "gate_mode: random\ndtype: bfloat16\n"))
    moe = assemble(recipe, root / "moe")
    params = sum(t.numel() for t in load_file(str(next(moe.glob("*.safetensors")))).values())
    config = Checkpoint(moe).config
    held_bf16 = params * 2 + float32_overhead(params, config) + VERIFY_OVERHEAD
    streamed = streamed_need(params, config)
    _, layer = layer_bytes(config, params)
    assert streamed + layer < held_bf16
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(streamed + layer // 2))  # one layer fits, the model does not

    def no_copy(*_a: object, **_k: object) -> None:
        raise AssertionError("a streamed verification wrote the artifact's dequantized weights to disk")

    with monkeypatch.context() as m:  # streamed, the artifact's tensors are dequantized as each layer reads them
        m.setattr(gguf_exporter, "artifact_checkpoint", no_copy)
        low = export(moe, tmp_path / "low", quant="q8_0")["parity"]
    assert low["reference"] == "transformers float32, layer by layer streamed from disk over bfloat16 weights"
    assert low["conversion"]["reference"] == (
        "transformers float32, layer by layer streamed from disk over float32 weights, on the artifact's "
        "dequantized weights"
    )
    assert low["gate"]["verdict"] == "pass"
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(held_bf16 + layer))  # the bf16 model fits, float32 does not
    full = export(moe, tmp_path / "full", quant="q8_0")["parity"]
    assert full["reference"] == "transformers float32, layer by layer over bfloat16 weights"
    # the same float32 arithmetic on the same weights (the artifact's dequantized ones in float32 streamed, in float16
    # held); only the windows per forward pass and that float16 rounding differ
    for n, diff in full["max_abs_logit_diff"].items():
        assert low["max_abs_logit_diff"][n] == pytest.approx(diff, abs=1e-4)
        assert low["conversion"]["max_abs_logit_diff"][n] == pytest.approx(
            full["conversion"]["max_abs_logit_diff"][n], rel=2e-3
        )
    assert low["ppl_reference"] == pytest.approx(full["ppl_reference"], rel=1e-5)
    assert low["top1_agreement"] == full["top1_agreement"]


def test_llama_cpp_keeps_the_weights_in_the_mapped_file_when_asked(tmp_path, monkeypatch):
    """llama.cpp's CPU backend copies 4-bit weights into its repacked layouts (a second, anonymous copy of them);
    ``repack=False`` (the streamed verification) loads the model with llama.cpp's ``use_extra_bufts`` off, only for
    that load, and the logits stay the same."""
    import llama_cpp._internals as internals
    import numpy as np

    from moetool.export.gguf.verify import llama_logits, load_llama

    d = save_dense(tmp_path / "wide", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=1, tie_word_embeddings=True)  # fmt: skip
    man = export(d, tmp_path / "q", quant="q4_0", verify=False)
    seen = []
    loader = internals.LlamaModel.__init__

    def spy(self, *a, params, **k):  # the parameters llama.cpp's model loader receives
        seen.append(bool(params.use_extra_bufts))
        loader(self, *a, params=params, **k)

    monkeypatch.setattr(internals.LlamaModel, "__init__", spy)
    logits = {}
    for repack in (True, False, True):
        llm = load_llama(tmp_path / "q" / man["file"], n_ctx=32, repack=repack)
        logits[repack] = llama_logits(llm, list(range(1, 20)))
        llm.close()
    assert seen == [True, False, True]
    np.testing.assert_allclose(logits[False], logits[True], atol=1e-4)
