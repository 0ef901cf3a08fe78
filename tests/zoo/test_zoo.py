"""The expert zoo, built for real with the `tiny` profile (corpora, tokenizer, base, experts, eval)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from moetool.errors import MoetoolError
from moetool.zoo import (
    DOMAINS,
    ZooConfig,
    build_zoo,
    load_domain_documents,
    make_splits,
    resolve_zoo_model,
    zoo_domain_text,
)
from moetool.zoo.corpora import normalize_whitespace

PROFILE = "tiny"
MODELS = ("base", *DOMAINS)


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=120)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def zoo(cache):
    """The tiny zoo, built where ``zoo_dir('tiny')`` finds it when ``MOETOOL_CACHE`` is ``cache``."""
    console = _quiet()
    result = build_zoo(PROFILE, root=cache / "zoo" / PROFILE, console=console)
    result.console_output = console.file.getvalue()  # type: ignore[attr-defined]
    return result


@pytest.fixture
def use_cache(cache, monkeypatch):
    monkeypatch.setenv("MOETOOL_CACHE", str(cache))
    return cache


def _weights_digest(model_dir: Path) -> str:
    tensors = load_file(model_dir / "model.safetensors")
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def test_layout_and_zoo_json(zoo):
    root = zoo.root
    assert not zoo.cached
    for name in MODELS:
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (root / name / f).is_file(), f"{name}/{f}"
    for d in DOMAINS:
        assert (root / "data" / d / "train.txt").stat().st_size > 0
        assert (root / "data" / d / "valid.txt").stat().st_size > 0
    meta = json.loads((root / "zoo.json").read_text())
    assert meta["config"] == ZooConfig.for_profile(PROFILE).to_dict()
    assert meta["seed"] == ZooConfig.for_profile(PROFILE).seed
    for m, row in zoo.perplexity.items():
        assert meta["perplexity"][m] == pytest.approx(row)
    assert meta["check"]["passed"] is True
    assert {"torch", "transformers", "tokenizers"} <= set(meta["versions"])
    assert not list(root.parent.glob(f".{root.name}.*")), "temporary build dirs left behind"
    assert "held-out perplexity" in zoo.console_output


def test_experts_beat_base_on_own_domain(zoo):
    matrix = zoo.perplexity
    assert set(matrix) == set(MODELS)
    for d in DOMAINS:
        assert set(matrix[d]) == set(DOMAINS)
        assert matrix[d][d] < matrix["base"][d], (d, matrix)
        # ... and the expert is better at its own domain than any other expert is
        assert matrix[d][d] == min(matrix[m][d] for m in DOMAINS), (d, matrix)


def test_models_and_tokenizer_load(zoo):
    tok = AutoTokenizer.from_pretrained(zoo.root / "base")
    ids = tok("def f(x): return x")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "def f(x): return x"
    assert {tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token} == {"<s>", "</s>", "<pad>", "<unk>"}
    base_sd = None
    for name in MODELS:
        model = AutoModelForCausalLM.from_pretrained(zoo.root / name, dtype=torch.float32)
        assert model.config.model_type == "llama"
        assert model.config.vocab_size == len(tok)
        assert model.config.bos_token_id == tok.bos_token_id
        assert model.config.tie_word_embeddings
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]))
        assert out.logits.shape == (1, len(ids), len(tok))
        sd = model.state_dict()
        if name == "base":
            base_sd = sd
            continue
        # experts ("mlp" setting): only the MLP weights moved away from the base
        assert base_sd is not None
        for key, value in sd.items():
            same = torch.equal(value, base_sd[key])
            assert same == (".mlp." not in key), key


def test_held_out_text_not_in_train(zoo):
    cfg = ZooConfig.for_profile(PROFILE)
    splits = make_splits(cfg.seed, cfg.max_chars_per_domain, cfg.valid_fraction, max_valid_chars=cfg.max_valid_chars)
    for d in DOMAINS:
        train = (zoo.root / "data" / d / "train.txt").read_text()
        valid = (zoo.root / "data" / d / "valid.txt").read_text()
        assert train == splits[d].train and valid == splits[d].valid
        assert splits[d].valid_docs and splits[d].train_docs
        assert len(train) <= cfg.max_chars_per_domain
        norm_train = normalize_whitespace(train)
        for doc in splits[d].valid_docs:
            assert normalize_whitespace(doc) not in norm_train


def test_second_build_is_cached(zoo):
    again = build_zoo(PROFILE, root=zoo.root, console=_quiet())
    assert again.cached
    for m, row in zoo.perplexity.items():
        assert again.perplexity[m] == pytest.approx(row)


def test_same_seed_same_weights(zoo, tmp_path):
    other = build_zoo(PROFILE, root=tmp_path / "again", console=_quiet())
    for name in MODELS:
        assert _weights_digest(other.root / name) == _weights_digest(zoo.root / name), name
    assert other.perplexity == zoo.perplexity


def test_resolve_and_domain_text(zoo, use_cache):
    assert resolve_zoo_model("legal", PROFILE) == zoo.root / "legal"
    assert zoo_domain_text("medical", "valid", PROFILE) == (zoo.root / "data/medical/valid.txt").read_text()
    assert zoo_domain_text("code", "train", PROFILE).strip()
    with pytest.raises(MoetoolError, match=r"zoo model 'nope' not found; run `moetool zoo build.*base, code"):
        resolve_zoo_model("nope", PROFILE)
    with pytest.raises(MoetoolError, match="unknown zoo domain"):
        zoo_domain_text("poetry", profile=PROFILE)


def test_missing_zoo_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path))
    with pytest.raises(MoetoolError, match="not found; run `moetool zoo build`"):
        resolve_zoo_model("base")
    with pytest.raises(MoetoolError, match="moetool zoo build"):
        zoo_domain_text("code")


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_root_holding_something_else_is_refused_and_kept(tmp_path, kind):
    """A root that exists, is not empty and has no zoo.json is someone else's: refused without --force, untouched."""
    root = tmp_path / "zoo"
    if kind == "folder":
        root.mkdir()
        (root / "notes.txt").write_text("mine")
    else:
        root.write_text("mine")
    with pytest.raises(MoetoolError, match=r"exists and is not a moetool zoo; remove it or pass force"):
        build_zoo(PROFILE, root=root, console=_quiet())
    assert (root / "notes.txt" if kind == "folder" else root).read_text() == "mine"


def test_failed_expert_check_is_reported(tmp_path):
    # experts that do not train at all cannot beat the base: the build says which, and still saves the matrix
    cfg = dataclasses.replace(
        ZooConfig.for_profile(PROFILE), base_steps=3, expert_steps=1, expert_lr=0.0, max_chars_per_domain=20_000
    )
    root = tmp_path / "zoo"
    stale = tmp_path / ".zoo.building-999999999-deadbeef"  # left by a killed build
    stale.mkdir()
    with pytest.raises(MoetoolError, match=r"expert 'code' does not beat the base on 'code'"):
        build_zoo(PROFILE, root=root, console=_quiet(), config=cfg)
    meta = json.loads((root / "zoo.json").read_text())
    assert meta["check"]["passed"] is False
    assert set(meta["perplexity"]) == set(MODELS)
    assert not stale.exists()


def test_corpora():
    for d in DOMAINS:
        docs = load_domain_documents(d)
        assert len(docs) >= 5 and all(doc.strip() for doc in docs)
    medical = "\n".join(load_domain_documents("medical")[:3])
    assert "A00.1: Cholera due to Vibrio cholerae 01, biovar eltor" in medical
    a = make_splits(1, 30_000, 0.2)
    b = make_splits(1, 30_000, 0.2)
    c = make_splits(2, 30_000, 0.2)
    assert a == b
    assert any(a[d].valid != c[d].valid for d in DOMAINS)
    with pytest.raises(MoetoolError, match="unknown zoo domain"):
        load_domain_documents("poetry")


def test_zoo_lists_models_trained_into_it_later(tmp_path, monkeypatch):
    """zoo.json names the build's models; a model added afterwards (zoo:mamba) is listed too, after them."""
    import json

    from moetool.errors import MoetoolError
    from moetool.zoo import resolve_zoo_model, zoo_models

    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path))
    root = tmp_path / "zoo" / "default"
    for name in ("base", "code", "mamba"):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
    (root / "zoo.json").write_text(json.dumps({"models": ["code", "base", "legal"]}))  # legal: listed, absent
    assert zoo_models() == ["code", "base", "mamba"]
    assert resolve_zoo_model("mamba") == root / "mamba"
    with pytest.raises(MoetoolError, match="available: code, base, mamba"):
        resolve_zoo_model("medical")
