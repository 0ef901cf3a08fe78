"""Every family's tokenizer written into GGUF and read back by llama.cpp (a vocab-only GGUF): llama.cpp's ids and text
must equal transformers' on a stress set, with and without special-token parsing."""

from __future__ import annotations

import ctypes
import json
import re
import unicodedata
from pathlib import Path

import llama_cpp
import pytest
from transformers import AutoTokenizer

from moetool.export import ExportError
from moetool.export.gguf import tokenizer_spm
from moetool.export.gguf.pretokenizers import PRE_TOKENIZERS, PROBES
from moetool.export.gguf.tokenizer import llama_cpp_equivalent, read_vocab, write_vocab
from moetool.export.gguf.verify import TOKENIZER_PROBES, quiet_stderr
from support.tokenizer_fixtures import (
    BYTE_LEVEL_FAMILIES,
    SPM_FAMILIES,
    byte_level_tokenizer,
    spm_tokenizer,
    vocab_only_gguf,
)

FAMILIES = SPM_FAMILIES + BYTE_LEVEL_FAMILIES
STRESS = (
    *TOKENIZER_PROBES,
    *PROBES,
    "",
    " ",
    "  x",
    "\t\n \n",
    "e\u0301 a\u0308 n\u0303o\u0308\u0301",  # combining marks
    "日本語と中文と한국어、ＦＵＬＬ　ｗｉｄｔｈ。",
    "🤖🚀👩\u200d💻 🏳️\u200d🌈 ❤️",
    "0 00 000 0000 3.14 1e-9 0x1F 1_000 ٣٤٥",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
)
# what llama.cpp's name for each family's pre-tokenizer may be: the first whose split and flags match
EXPECTED_PRE = {
    "gpt-2": {"gpt-2", "trillion"},  # same regex; which one depends on whether transformers cleans spaces
    "llama-bpe": {"llama-bpe"},
    "qwen2": {"qwen2"},
    "smollm": {"smollm"},
    "starcoder": {"starcoder", "smollm"},
    "deepseek-llm": {"deepseek-llm"},
    "deepseek-coder": {"deepseek-coder"},
}


def _build(out: Path, family: str) -> Path:
    return (spm_tokenizer if family in SPM_FAMILIES else byte_level_tokenizer)(out, family)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """family → (model dir, HF tokenizer, llama.cpp vocab-only model), built once per module."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            d = _build(tmp_path_factory.mktemp(family), family)
            gguf_path = vocab_only_gguf(d, d / "vocab.gguf")
            with quiet_stderr():
                llm = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
            cache[family] = (d, AutoTokenizer.from_pretrained(str(d)), llm)
        return cache[family]

    return get


def _with_specials(tok) -> list[str]:
    """Each special and added token inside text: at the start, mid-word, before spaces and newlines."""
    toks = [*tok.all_special_tokens, *tok.get_added_vocab()]
    return [f"{t}Hello {t} world{t}\n{t}  x {t}" for t in dict.fromkeys(toks)]


def _text(family: str, s: str) -> str:
    # llama.cpp applies no normalizer: Qwen2's NFC holds only for text already in NFC (test_nfc_is_a_known_limit)
    return unicodedata.normalize("NFC", s) if family == "qwen2" else s


def _detokenize(llm, ids: list[int]) -> str:
    """llama.cpp's own detokenizer (llama-cpp-python's Python wrapper strips a space after BOS by itself)."""
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, len(buf), True, False)
    return buf.raw[:n].decode("utf-8", errors="replace")


def _legacy(tok):
    """``tok``'s backend with sentencepiece's own whitespace rule (the legacy ``Prepend('▁')`` normalizer)."""
    from tokenizers import Tokenizer

    tj = json.loads(tok.backend_tokenizer.to_str())
    prepend, spaces = (
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    )
    tj.update(normalizer={"type": "Sequence", "normalizers": [prepend, spaces]}, pre_tokenizer=None)
    return Tokenizer.from_str(json.dumps(tj))


def _known_difference(notes: list[str], tok, s: str, special: bool) -> bool:
    """Whether ``s`` falls under a difference read_vocab names (transformers 5's Metaspace, see tokenizer_spm)."""
    added = json.loads(tok.backend_tokenizer.to_str())["added_tokens"]
    split = [re.escape(t["content"]) for t in added if special or not t["special"]]  # user-defined: always split
    pieces = re.split("|".join(split), s) if split else [s]
    if tokenizer_spm.SPACE_LED in notes and any(p.startswith(" ") for p in pieces):
        return True
    return tokenizer_spm.AFTER_SPECIAL in notes and len(pieces) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_tokenizes_as_transformers(loaded, family):
    """Equal ids on every stress string; where read_vocab names a known difference (a SentencePiece vocab under
    transformers 5's Metaspace), llama.cpp's ids are instead sentencepiece's rule, exactly."""
    d, tok, llm = loaded(family)
    notes = read_vocab(d).notes
    legacy = _legacy(tok) if notes else None
    bad = []
    for raw in (*STRESS, *_with_specials(tok)):
        s = _text(family, raw)
        for special in (True, False):
            ref = tok(s, split_special_tokens=not special).input_ids
            if legacy is not None and _known_difference(notes, tok, s, special):
                legacy.encode_special_tokens = not special
                ref = legacy.encode(s).ids
            got = llm.tokenize(s.encode(), add_bos=True, special=special)
            if list(got) != ref:
                bad.append((s, special, tok.convert_ids_to_tokens(ref), tok.convert_ids_to_tokens(got)))
    assert not bad, bad[:3]


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_detokenizes_as_transformers(loaded, family):
    d, tok, llm = loaded(family)
    v = read_vocab(d)
    # llama.cpp's clean_spaces drops ' .'/' ,'/" 's" spaces; transformers 5 never cleans a BPE's output, and Llama-3
    # has no llama.cpp name with its regex that does not clean: those strings are left out for that family
    cleans = v.model == "gpt2" and PRE_TOKENIZERS[v.pre].clean_spaces
    bad = []
    for raw in (*STRESS, *_with_specials(tok)):
        s = _text(family, raw)
        ids = tok(s, add_special_tokens=False).input_ids
        ref = tok.decode(ids, skip_special_tokens=True)
        if cleans and re.search(r" [?!.,']", ref):
            continue
        if v.model == "llama" and ids and v.token_types[ids[0]] in (2, 3):  # unknown, control
            # llama.cpp spends its strip of the leading space on the first token even when that token prints
            # nothing (a special one skipped); transformers strips the first printed space (known limit)
            continue
        if _detokenize(llm, ids) != ref:
            bad.append((s, ref, _detokenize(llm, ids)))
    assert not bad, bad[:3]


@pytest.mark.parametrize("family", BYTE_LEVEL_FAMILIES)
def test_pre_tokenizer_is_named_by_behaviour(loaded, family):
    d, _, llm = loaded(family)
    pre = read_vocab(d).pre
    assert pre in EXPECTED_PRE[family]
    assert llm.metadata["tokenizer.ggml.pre"] == pre and llm.metadata["tokenizer.ggml.model"] == "gpt2"


def test_pre_tokenizer_regexes_are_llama_cpps_own():
    """The table is the installed llama.cpp's regexes, byte for byte (a llama.cpp upgrade that changes one fails)."""
    lib = next(Path(llama_cpp.__file__).parent.glob("lib/libllama.so*")).read_bytes()
    missing = [(n, r) for n, p in PRE_TOKENIZERS.items() for r in p.regexes if r != "[\r\n]" and r.encode() not in lib]
    assert not missing


@pytest.mark.parametrize("family", ("llama2", "phi3"))
def test_sentencepiece_vocab_types_and_flags(loaded, family):
    d, tok, llm = loaded(family)
    vocab = llm._model.vocab
    attr = lambda t: llama_cpp.llama_vocab_get_attr(vocab, tok.convert_tokens_to_ids(t))  # noqa: E731
    assert llm.metadata["tokenizer.ggml.model"] == "llama"
    assert attr("<0x0A>") & llama_cpp.LLAMA_TOKEN_ATTR_BYTE
    assert attr("<unk>") & llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
    assert attr("</s>") & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    assert llama_cpp.llama_vocab_get_add_bos(vocab) == (tok("a").input_ids[0] == tok.bos_token_id)
    assert not llama_cpp.llama_vocab_get_add_eos(vocab)
    assert llm.metadata["tokenizer.chat_template"] == tok.chat_template
    # every id transformers stops on (generation_config's list) ends generation in llama.cpp too
    for i in json.loads((d / "generation_config.json").read_text())["eos_token_id"] if family == "phi3" else []:
        assert llama_cpp.llama_vocab_is_eog(vocab, i)
    if family == "llama2":
        assert attr("<|note|>") & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED


@pytest.mark.parametrize("family", ("llama-bpe", "qwen2"))
def test_byte_level_special_ids(loaded, family):
    d, tok, llm = loaded(family)
    vocab = llm._model.vocab
    assert llama_cpp.llama_vocab_get_add_bos(vocab) == (family == "llama-bpe")
    assert llama_cpp.llama_vocab_eos(vocab) == tok.eos_token_id
    for i in json.loads((d / "generation_config.json").read_text())["eos_token_id"]:
        assert llama_cpp.llama_vocab_is_eog(vocab, i)
    if tok.pad_token_id is not None:
        assert llama_cpp.llama_vocab_pad(vocab) == tok.pad_token_id


def _flat_scores_differ(tmp_path: Path) -> tuple[list[int], list[int], list[int]]:
    """A byte-fallback BPE whose merges join 'bc' before 'ab': transformers' ids for "abc", llama.cpp's with our
    scores, and llama.cpp's with every score -1000 (what its converter writes from a tokenizer.json alone)."""
    import gguf
    from tokenizers import Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", "a", "b", "c", "ab", "bc"]
    bpe = models.BPE(
        {p: i for i, p in enumerate(pieces)}, [("b", "c"), ("a", "b")], unk_token="<unk>", byte_fallback=True
    )
    t = Tokenizer(bpe)
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        str(tmp_path / "t")
    )
    ids = []
    for name, flat in (("ours", False), ("flat", True)):
        v = read_vocab(tmp_path / "t")
        if flat:
            v.scores = [-1000.0] * len(v.tokens)
        w = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        write_vocab(w, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        with quiet_stderr():
            llm = llama_cpp.Llama(str(tmp_path / f"{name}.gguf"), vocab_only=True, verbose=False)
        ids.append(llm.tokenize(b"abc", add_bos=False))
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "t"))("abc", add_special_tokens=False).input_ids
    return hf, ids[0], ids[1]


def test_scores_from_merge_ranks_order_llama_cpps_joins(tmp_path):
    """llama.cpp joins the highest-scored pair; with equal scores (its converter's -1000 for a tokenizer.json) it
    joins left to right and 'abc' becomes ab+c where transformers' merges give a+bc. Ranks as scores agree."""
    hf, ours, flat = _flat_scores_differ(tmp_path)
    assert ours == hf
    assert flat != hf


def test_embedding_rows_past_the_vocabulary_are_unused(tmp_path):
    d = spm_tokenizer(tmp_path / "t", "llama2")
    n = len(AutoTokenizer.from_pretrained(str(d)))
    v = read_vocab(d, n + 3)
    assert v.tokens[-1] == f"[PAD{n + 2}]" and v.token_types[-3:] == [5, 5, 5] and len(v.scores or []) == n + 3


def test_phi3_strip_needs_llama_cpps_name_rule(loaded, tmp_path):
    """llama.cpp strips whitespace after Phi-3's tokens only in a model named phi-3: the name gets the marker, and
    without it llama.cpp keeps the whitespace transformers drops."""
    import gguf

    d, tok, llm = loaded("phi3")
    assert "phi-3" in llm.metadata["general.name"].lower()
    v = read_vocab(d)
    v.name_marker = None
    w = gguf.GGUFWriter(str(tmp_path / "unnamed.gguf"), "llama")
    w.add_name("tiny")
    write_vocab(w, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with quiet_stderr():
        unnamed = llama_cpp.Llama(str(tmp_path / "unnamed.gguf"), vocab_only=True, verbose=False)
    s = "<|user|>\n  hi<|end|>\n<|assistant|> ok"
    assert unnamed.tokenize(s.encode(), add_bos=False, special=True) != tok(s).input_ids


def test_nfc_is_a_known_limit(loaded):
    """Qwen2 normalizes to NFC and llama.cpp does not: decomposed text tokenizes differently, NFC text the same."""
    d, tok, llm = loaded("qwen2")
    s = "cafe\u0301 na\u0308ive"
    assert llm.tokenize(s.encode(), add_bos=False) != tok(s).input_ids
    nfc = unicodedata.normalize("NFC", s)
    assert llm.tokenize(nfc.encode(), add_bos=False) == tok(nfc).input_ids
    assert any("NFC" in n for n in read_vocab(d).notes)


def _edit(d: Path, change) -> Path:
    tj = json.loads((d / "tokenizer.json").read_text())
    change(tj)
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


def test_metaspace_leading_space_is_a_known_limit(loaded):
    """transformers 5 rebuilds a LlamaTokenizer with Metaspace, which adds no '▁' before text that starts with a
    space; llama.cpp (as sentencepiece) does: its ids for s are transformers' for ' ' + s, and read_vocab says so."""
    d, tok, llm = loaded("llama2")
    assert tokenizer_spm.SPACE_LED in read_vocab(d).notes
    s = "  leading spaces"
    assert llm.tokenize(s.encode(), add_bos=True) != tok(s).input_ids
    assert llm.tokenize(s.encode(), add_bos=True) == tok(" " + s).input_ids
    v = read_vocab(d)
    for p in TOKENIZER_PROBES:  # what a parity gate can compare against: exact for every probe
        assert llm.tokenize(p.encode(), add_bos=True) == tok(llama_cpp_equivalent(v, p)).input_ids, p
    d_fast, tok_fast, llm_fast = loaded("llama2-fast")  # the legacy normalizer, as tokenizer.json writes it
    assert not read_vocab(d_fast).notes and llm_fast.tokenize(s.encode(), add_bos=True) == tok_fast(s).input_ids


def test_normalizers_llama_cpp_does_not_apply_are_refused(tmp_path):
    d = _edit(byte_level_tokenizer(tmp_path / "b", "gpt-2"), lambda tj: tj.update(normalizer={"type": "NFKC"}))
    with pytest.raises(ExportError, match="NFKC normalizer"):
        read_vocab(d)
    lower = {
        "type": "Sequence",
        "normalizers": [{"type": "Lowercase"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}],
    }
    d = _edit(spm_tokenizer(tmp_path / "s", "llama2-fast"), lambda tj: tj.update(normalizer=lower))
    with pytest.raises(ExportError, match="Lowercase"):
        read_vocab(d)


def test_missing_byte_tokens_are_refused(tmp_path):
    d = _edit(spm_tokenizer(tmp_path / "s", "llama2"), lambda tj: tj["model"]["vocab"].pop("<0x41>"))
    with pytest.raises(ExportError, match="<0x41>"):
        tokenizer_spm.check_bytes(list(json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]), "x")


def test_unknown_split_regex_is_refused(tmp_path):
    def words_only(tj):
        tj["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": r"\S+|\s+"}

    d = _edit(byte_level_tokenizer(tmp_path / "b", "qwen2"), words_only)
    with pytest.raises(ExportError, match="not one llama.cpp implements.*closest"):
        read_vocab(d)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_with_the_family_tokenizer_exports_with_parity(tmp_path, family):
    """The whole GGUF export of a tiny model carrying each family's tokenizer: its own parity gate (tokenizer probes,
    logits at two lengths) passes in llama.cpp. A LlamaTokenizer class that transformers 5 rebuilds with Metaspace
    (llama2, tinyllama, phi3) is compared on the text llama.cpp's '▁' makes equivalent, and the manifest says so."""
    from conftest import save_dense
    from moetool.api import export

    d = save_dense(tmp_path / "m", "qwen2" if family == "qwen2" else "llama", vocab_size=768, pad_token_id=None)
    for f in d.glob("tokenizer*"):
        f.unlink()
    _build(d, family)
    man = export(d, tmp_path / "o", quant="f32")
    assert man["parity"]["tokenizer_match"], man["parity"]["tokenizer_mismatches"]
    assert man["parity"]["top1_agreement"] == 1.0
    assert set(read_vocab(d).notes) <= set(man["notes"])  # known differences are said in the manifest
    assert (tokenizer_spm.SPACE_LED in man["notes"]) == (tokenizer_spm.SPACE_LED in read_vocab(d).notes)


def test_pre_tokenizer_follows_what_transformers_runs(tmp_path):
    """SmolLM's repos name GPT2Tokenizer, which transformers 5 rebuilds without the tokenizer.json's digit split:
    the name is chosen from what transformers runs (GPT-2's regex), so llama.cpp still agrees with it."""
    d = byte_level_tokenizer(tmp_path / "s", "smollm")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    tok = AutoTokenizer.from_pretrained(str(d))
    assert read_vocab(d).pre in {"gpt-2", "trillion"}
    with quiet_stderr():
        llm = llama_cpp.Llama(str(vocab_only_gguf(d, d / "v.gguf")), vocab_only=True, verbose=False)
    for s in STRESS:
        assert llm.tokenize(s.encode(), add_bos=False) == tok(s).input_ids, s
