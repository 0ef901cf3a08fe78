"""Preflight rejects incompatible inputs with a message naming the problem, before anything is written."""

from __future__ import annotations

import pytest

import moetool.io.writer as writer_mod
from conftest import make_tokenizer, save_dense, write_recipe
from moetool.api import assemble
from moetool.errors import OutputExistsError, PreflightError, SourceError, UnsupportedArchitecture


def _recipe(tmp_path, base, experts, extra=""):
    lines = "\n".join(f"  - {{name: x{i}, source: {p}}}" for i, p in enumerate(experts))
    return write_recipe(
        tmp_path / "r.yaml",
        f"name: t\nmethod: mofe\nbase_model: {base}\ngate_mode: random\nexperts_per_token: 1\n{extra}"
        f"experts:\n{lines}\n",
    )


def _fails(tmp_path, recipe, exc, *fragments):
    with pytest.raises(exc) as info:
        assemble(recipe, tmp_path / "out")
    for frag in fragments:
        assert frag in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "moetool-tmp" in p.name]


def test_mismatched_shapes(tiny_models, tmp_path):
    m = tiny_models("llama")
    wide = save_dense(tmp_path / "wide", "llama", intermediate_size=64)
    _fails(
        tmp_path,
        _recipe(tmp_path, m["base"], [m["e1"], wide]),
        PreflightError,
        "experts.1.source",
        "model.layers.0.mlp.gate_proj.weight has shape [64, 32], base has [48, 32]",
    )


def test_mismatched_vocabulary(tiny_models, tmp_path):
    m = tiny_models("llama")
    other = save_dense(tmp_path / "v", "llama", vocab_size=400)
    _fails(
        tmp_path,
        _recipe(tmp_path, m["base"], [other]),
        PreflightError,
        "experts.0.source: vocab_size is 400 but the base has 320",
    )


def test_mismatched_tokenizer(tiny_models, tmp_path):
    m = tiny_models("llama")
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    other = tmp_path / "tok"
    shutil.copytree(m["e1"], other)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (other / f).unlink(missing_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["entirely different words here"],
        trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>"]),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(str(other))
    _fails(
        tmp_path,
        _recipe(tmp_path, m["base"], [other]),
        PreflightError,
        "experts.0.source: its tokenizer differs from the base's",
    )


def test_different_family(tiny_models, tmp_path):
    m = tiny_models("llama")
    q = tiny_models("qwen3")
    _fails(
        tmp_path,
        _recipe(tmp_path, m["base"], [q["e1"]]),
        PreflightError,
        "experts.0.source: model_type is 'qwen3' but the base has 'llama'",
    )


def test_unsupported_architecture_lists_supported(tiny_models, tmp_path):
    q = tiny_models("qwen3")
    r = _recipe(tmp_path, q["base"], [q["e1"]], extra="architecture: mixtral\n")
    _fails(tmp_path, r, UnsupportedArchitecture, "architecture: mixtral accepts llama/mistral bases, not 'qwen3'")


def test_unsupported_family(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=320)).save_pretrained(str(d))
    make_tokenizer(d)
    _fails(
        tmp_path,
        _recipe(tmp_path, d, [d]),
        PreflightError,
        "base_model: 'gpt2' is not a supported dense family (supported: llama, mistral, qwen2, qwen3, granite)",
    )


def test_no_compatible_arch_for_biased_llama(tmp_path):
    b = save_dense(tmp_path / "b", "llama", attention_bias=True)
    _fails(
        tmp_path,
        _recipe(tmp_path, b, [b]),
        UnsupportedArchitecture,
        "no output architecture accepts",
        "mixtral: has no attention biases",
        "qwen3_moe: accepts qwen3",
    )


def test_missing_source(tiny_models, tmp_path):
    m = tiny_models("llama")
    _fails(
        tmp_path,
        _recipe(tmp_path, m["base"], [tmp_path / "nope"]),
        PreflightError,
        "experts.0.source:",
        "no such model directory",
    )


def test_pickle_only_checkpoint_needs_flag(tiny_models, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file

    m = tiny_models("llama")
    p = tmp_path / "pickled"
    shutil.copytree(m["e1"], p)
    torch.save(load_file(str(p / "model.safetensors")), p / "pytorch_model.bin")
    (p / "model.safetensors").unlink()
    r = _recipe(tmp_path, m["base"], [p])
    _fails(tmp_path, r, PreflightError, "only pickle weights", "--allow-pickle")
    assert assemble(r, tmp_path / "ok", allow_pickle=True).is_dir()


def test_zoo_source_without_zoo(tmp_path, monkeypatch, tiny_models):
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    m = tiny_models("llama")
    with pytest.raises(SourceError, match="zoo"):
        from moetool.io.sources import resolve_source

        resolve_source("zoo:code")
    _fails(tmp_path, _recipe(tmp_path, m["base"], ["zoo:code"]), PreflightError, "experts.0.source")


def test_existing_output_needs_force(tiny_models, tmp_path):
    m = tiny_models("llama")
    r = _recipe(tmp_path, m["base"], [m["e1"]])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--force"):
        assemble(r, out)
    assert (out / "keep.txt").read_text() == "mine"
    assemble(r, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()


def test_failure_midway_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    m = tiny_models("llama")
    r = _recipe(tmp_path, m["base"], [m["e1"], m["e2"]])
    calls = {"n": 0}
    real_add = writer_mod.ShardedWriter.add

    def flaky(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt  # an interrupted run, the hardest case
        return real_add(self, name, tensor)

    monkeypatch.setattr(writer_mod.ShardedWriter, "add", flaky)
    with pytest.raises(KeyboardInterrupt):
        assemble(r, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "moetool" in p.name]


def test_failure_midway_keeps_previous_output(tiny_models, tmp_path, monkeypatch):
    m = tiny_models("llama")
    r = _recipe(tmp_path, m["base"], [m["e1"]])
    out = assemble(r, tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()

    def boom(self, name, tensor):
        raise RuntimeError("disk full")

    monkeypatch.setattr(writer_mod.ShardedWriter, "add", boom)
    with pytest.raises(RuntimeError):
        assemble(r, out, force=True)
    assert (out / "model.safetensors").read_bytes() == before
