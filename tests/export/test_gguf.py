"""GGUF export proven in llama.cpp: tiny Mixtral (3 experts), Qwen2-MoE (shared expert), Qwen3-MoE and dense models."""

from __future__ import annotations

import json

import gguf
import llama_cpp  # noqa: F401  (the dev extra installs it; a missing runtime must fail, not skip)
import numpy as np
import pytest

from conftest import save_dense, write_recipe
from moetool.api import assemble, export, plan_export
from moetool.errors import OutputExistsError
from moetool.export import ExportError

EXPERTS3 = """
experts:
  - {{name: code, source: {e1}, positive_prompts: ["def main():"]}}
  - {{name: legal, source: {e2}, positive_prompts: ["Permission is hereby granted"]}}
  - {{name: medical, source: {e3}, positive_prompts: ["acute bronchitis"]}}
"""


def _merge(tmp, m, name, extra=""):
    text = f"name: {name}\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\n{extra}\n" + EXPERTS3.format(
        e1=m["e1"], e2=m["e2"], e3=m["e3"]
    )
    return assemble(write_recipe(tmp / f"{name}.yaml", text), tmp / name)


@pytest.fixture(scope="module")
def mixtral(tiny_models, tmp_path_factory):
    return _merge(tmp_path_factory.mktemp("mx"), tiny_models("llama"), "mx3")


def _parity(manifest):
    p = manifest["parity"]
    assert p["tokenizer_match"], p["tokenizer_mismatches"]
    assert p["seq_lens"] == [32, 128]
    return p


def test_mixtral_three_experts_f32(mixtral, tmp_path):
    m = export(mixtral, tmp_path / "f32", quant="f32")
    p = _parity(m)
    assert m["llama_cpp_arch"] == "llama"
    assert max(p["max_abs_logit_diff"].values()) <= 1e-3
    assert p["top1_agreement"] == 1.0 and abs(p["ppl_change"]) < 1e-4
    reader = gguf.GGUFReader(str(tmp_path / "f32" / m["file"]))
    assert int(reader.fields["llama.expert_count"].parts[-1][0]) == 3
    exps = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    assert list(exps.shape) == [32, 48, 3]  # ne order: hidden, ff, experts
    on_disk = json.loads((tmp_path / "f32" / "manifest.json").read_text())
    assert (
        on_disk["model"]["weights_sha256"]
        and on_disk["artifact"]["bytes"] == (tmp_path / "f32" / m["file"]).stat().st_size
    )


def test_load_llama_thread_count_keeps_the_logits(mixtral, tmp_path):
    """bench/export_latency.py --llama-threads: a fixed llama.cpp thread count is honoured and computes the same."""
    from moetool.export.gguf.verify import llama_logits, load_llama

    m = export(mixtral, tmp_path / "f32", quant="f32", verify=False)
    ids = list(range(4, 36))
    logits = {}
    for threads in (None, 1):
        llm = load_llama(tmp_path / "f32" / m["file"], n_ctx=64, n_threads=threads)
        try:
            if threads:
                assert llm.n_threads == threads
            logits[threads] = llama_logits(llm, ids)
        finally:
            llm.close()
    assert np.abs(logits[None] - logits[1]).max() <= 1e-4


def test_mixtral_f16_and_quantized_plans(mixtral, tmp_path):
    p = _parity(export(mixtral, tmp_path / "f16", quant="f16"))
    assert max(p["max_abs_logit_diff"].values()) <= 1e-2
    m = export(mixtral, tmp_path / "q", quant="experts=q4_0,router=f32,*=q8_0")
    p = _parity(m)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q" / m["file"])).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == "F16"  # rows of 48: no 32-block fits, llama.cpp's fallback
    assert types["blk.1.ffn_up_exps.weight"] == "Q4_0" and types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.attn_norm.weight"] == "F32"
    assert 0.5 < p["top1_agreement"] <= 1.0 and p["ppl_artifact"] > 0
    assert any("q4_0 → f16" in n for n in m["notes"])


def test_qwen2_moe_shared_expert(tiny_models, tmp_path):
    m = tiny_models("qwen2")
    shared = f"shared_expert: {{source: {m['base']}, positive_prompts: ['def']}}\n"
    normed = _merge(tmp_path, m, "q2n", shared + "norm_topk_prob: true\n")
    with pytest.raises(ExportError, match="norm_topk_prob: false"):
        plan_export(normed, tmp_path / "x", quant="f32")
    plain = _merge(tmp_path, m, "q2", shared + "norm_topk_prob: false\n")
    man = export(plain, tmp_path / "q2-f32", quant="f32")
    assert man["llama_cpp_arch"] == "qwen2moe"
    assert max(_parity(man)["max_abs_logit_diff"].values()) <= 1e-3


def test_qwen2_moe_without_shared_expert_uses_llama_moe(tiny_models, tmp_path):
    m = tiny_models("qwen2")
    man = export(_merge(tmp_path, m, "q2ns", "norm_topk_prob: true\n"), tmp_path / "o", quant="f32")
    assert man["llama_cpp_arch"] == "llama" and any("Mixtral form" in n for n in man["notes"])
    assert max(_parity(man)["max_abs_logit_diff"].values()) <= 1e-3
    zero = _merge(tmp_path, m, "q2z")  # the default: un-normalised
    man = export(zero, tmp_path / "z", quant="f32")
    assert man["llama_cpp_arch"] == "qwen2moe" and any("zero" in n for n in man["notes"])
    assert max(_parity(man)["max_abs_logit_diff"].values()) <= 1e-3


def test_qwen3_moe(tiny_models, tmp_path):
    man = export(_merge(tmp_path, tiny_models("qwen3"), "q3"), tmp_path / "o", quant="f32")
    assert man["llama_cpp_arch"] == "qwen3moe"
    assert max(_parity(man)["max_abs_logit_diff"].values()) <= 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_dense_models(tiny_models, tmp_path, family):
    man = export(tiny_models(family)["base"], tmp_path / family, quant="f32")
    assert max(_parity(man)["max_abs_logit_diff"].values()) <= 1e-3


def test_k_quants_come_from_llama_cpp(tmp_path):
    """Rows of 256 take K types; they are produced by llama.cpp's quantizer and the file holds what the plan says."""
    d = save_dense(
        tmp_path / "wide",
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        tie_word_embeddings=True,
    )
    man = export(d, tmp_path / "k", quant="ffn=q4_k,attention=q6_k,*=q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "k" / man["file"])).tensors}
    assert types["blk.0.ffn_gate.weight"] == "Q4_K" and types["blk.0.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.attn_q.weight"] == "Q6_K" and types["token_embd.weight"] == "Q8_0"
    assert "output.weight" not in types  # tied: llama.cpp reuses token_embd
    p = _parity(man)
    assert p["conversion"]["top1_agreement"] >= 0.95 and np.isfinite(p["ppl_artifact"])


def test_output_is_not_overwritten_without_force(mixtral, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--force"):
        export(mixtral, tmp_path / "o", quant="f32", verify=False)
    assert (tmp_path / "o" / "keep.txt").read_text() == "mine"


def test_failed_parity_leaves_nothing(mixtral, tmp_path, monkeypatch):
    from moetool.export.gguf import exporter

    monkeypatch.setitem(exporter.GATES, "f32", 1e-12)
    with pytest.raises(ExportError, match="parity failed"):
        export(mixtral, tmp_path / "bad", quant="f32")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))


def test_zero_shared_expert_gate_is_not_nan(tiny_models, tmp_path):
    """moetool writes a zero shared-expert gate when no prompts are given; llama.cpp's silu(x)/x would be NaN."""
    m = tiny_models("qwen2")
    moe = _merge(tmp_path, m, "q2g", f"shared_expert: {{source: {m['base']}}}\nnorm_topk_prob: false\n")
    man = export(moe, tmp_path / "o", quant="f32")
    assert max(_parity(man)["max_abs_logit_diff"].values()) <= 1e-3


QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_qwen2_style_split_pretokenizer(tmp_path):
    """A Split(regex) + ByteLevel tokenizer maps to llama.cpp's 'qwen2' pre-tokenizer and tokenizes identically."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from conftest import TEXT
    from moetool.export.gguf.tokenizer import read_vocab

    d = save_dense(tmp_path / "q", "qwen2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    for f in d.glob("tokenizer*"):
        f.unlink()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(d))
    assert read_vocab(d).pre == "qwen2"
    man = export(d, tmp_path / "o", quant="f32")
    assert _parity(man)["tokenizer_match"]


def test_unknown_pretokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = save_dense(tmp_path / "w", "llama")
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    for f in d.glob("tokenizer*"):
        f.unlink()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(d))
    with pytest.raises(ExportError, match="not one llama.cpp implements"):
        export(d, tmp_path / "o", quant="f32")
    assert not (tmp_path / "o").exists()


def test_verification_copy_lives_in_the_outputs_temporary_folder(mixtral, tmp_path, monkeypatch):
    """The dequantized copy of the artifact's weights used to go to $TMPDIR, where a SIGKILL left a full copy of
    the model that no later run removed; inside the output's temporary folder, the next run sweeps it."""
    import tempfile

    from moetool.export.gguf import verify

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    tempfile.tempdir = None  # re-read TMPDIR
    seen = []
    real = verify.compare

    def spy(*args, **kwargs):
        seen.append(kwargs["artifact_weights"])
        return real(*args, **kwargs)

    monkeypatch.setattr(verify, "compare", spy)
    try:
        export(mixtral, tmp_path / "out", quant="q8_0")
    finally:
        tempfile.tempdir = None
    assert seen and ".out.moetool-tmp-" in str(seen[0]) and not list((tmp_path / "tmp").iterdir())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
