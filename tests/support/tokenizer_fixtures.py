"""Each family's tokenizer rebuilt offline: the family's model, normalizer, pre-tokenizer, decoder, post-processor and
special tokens, with a small vocabulary trained on :data:`CORPUS` (SentencePiece for the byte-fallback families,
``tokenizers`` for the byte-level ones), saved as a Hugging Face tokenizer folder."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

_LINES = (
    "The quick brown fox jumps over the lazy dog. It's 2026; we'll see 12345 items at $3.50 each!",
    "def main(argv):\n    for i in range(10):\n        print(f'{i:03d}', argv[i])  # loop\n\treturn 0\n",
    "if (a != b && c <= 0x1F) { y = arr[i++]; } // done\r\nclass A:\n    pass\n",
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software.",
    "Acute bronchitis; diabetes mellitus type 2 (E11.9); fracture of the femur.",
    "naïve café résumé Überprüfung straße Ελληνικά γλώσσα Привет мир עברית مرحبا بالعالم",
    "日本語のテキストです。中文字符测试，你好世界！한국어 문장입니다. 🤖🚀✨ emoji  and   spaces",
    "don't won't they've I'm it's 'quoted' \"double\" — dash – en ‘curly’ “quotes” … ellipsis",
)
CORPUS = "\n".join(_LINES * 6)

LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPM_TEMPLATE = "{% for m in messages %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]{% endfor %}"


def _save(tok: Tokenizer, out: Path, gen_eos: list[str] | None = None, **config: Any) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (``config``'s keys; token names as strings)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, **config}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    if gen_eos:
        ids = [tok.token_to_id(t) for t in gen_eos]
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return out


# --- SentencePiece-style BPE (byte fallback) --------------------------------------------------------------------

SPM_FAMILIES = ("llama2", "mistral", "tinyllama", "phi3", "llama2-fast")
# tokenizer_config's legacy flag per family (its tokenizer_class is LlamaTokenizer, which transformers 5 rebuilds
# with a Metaspace pre-tokenizer: 'always' when legacy, else 'first'); llama2-fast keeps tokenizer.json verbatim
_LEGACY = {"llama2": False, "mistral": True, "tinyllama": False, "phi3": False}


def _spm_model() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A SentencePiece BPE (byte fallback, digits split) and the merges transformers derives from its scores."""
    import sentencepiece as sp
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers.tokenization_utils_base import generate_merges

    buf = io.BytesIO()
    sp.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_writer=buf,
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        character_coverage=0.9995,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    proto = pb.ModelProto()
    proto.ParseFromString(buf.getvalue())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    merges = generate_merges(vocab, {p.piece: p.score for p in proto.pieces})
    return vocab, merges


def spm_tokenizer(out: Path, family: str = "llama2") -> Path:
    """A byte-fallback BPE laid out as ``family``'s tokenizer.json (Llama-2's converter output, legacy or Metaspace).

    Llama-2 gets a non-special added token; Mistral adds control tokens ([INST], [/INST]); Phi-3 adds its chat
    tokens after the vocabulary (stripping whitespace on their right), ends on ``<|endoftext|>`` with ``<|end|>`` as
    a further end id, and does not add BOS.
    """
    vocab, merges = _spm_model()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    cfg: dict[str, Any] = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": _SPM_TEMPLATE,
    }
    gen_eos = None
    if family == "mistral":
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("[INST]", "[/INST]")])
    if family in _LEGACY:
        cfg.update(tokenizer_class="LlamaTokenizer", legacy=_LEGACY[family], add_bos_token=family != "phi3")
    if family in ("llama2", "llama2-fast"):  # a fine-tune's added word: not special, so always split out (user-defined)
        tok.add_tokens([AddedToken("<|note|>", normalized=False)])
    if family == "phi3":  # its chat tokens strip the whitespace on their right, as do </s> and the placeholders
        tok.add_special_tokens([AddedToken("<|endoftext|>", normalized=False, special=True)])
        names = ("<|assistant|>", "<|placeholder1|>", "<|system|>", "<|end|>", "<|user|>")
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True, rstrip=True) for t in names])
        tok.add_special_tokens([AddedToken("</s>", normalized=False, special=True, rstrip=True)])
        cfg.update(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        cfg["chat_template"] = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        gen_eos = ["<|endoftext|>", "<|end|>"]
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return _save(tok, out, gen_eos, **cfg)


# --- byte-level BPE -------------------------------------------------------------------------------------------------

BYTE_LEVEL_FAMILIES = ("gpt-2", "llama-bpe", "qwen2", "smollm", "starcoder", "deepseek-llm", "deepseek-coder")
_LETTERS = "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DS_SPLITS = {
    # DeepSeek's own splits (escaped: several letters have canonical equivalents that editors rewrite)
    "deepseek-llm": ("[\r\n]", _LETTERS, _PUNCT, "\\s+$", _CJK),
    "deepseek-coder": ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK),
}


def _byte_level_pre(family: str) -> Any:
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if family == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family in ("llama-bpe", "qwen2"):
        regex = LLAMA3_SPLIT if family == "llama-bpe" else QWEN2_SPLIT
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"), bl])
    if family in ("smollm", "starcoder"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _DS_SPLITS[family]]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.Digits(individual_digits=True), bl])


# family → (special tokens, tokenizer_config, bos added by the post-processor, generation_config eos list)
_BYTE_LEVEL_SPECIALS: dict[str, tuple[tuple[str, ...], dict[str, Any], str | None, list[str] | None]] = {
    "gpt-2": (
        ("<|endoftext|>",),
        {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "clean_up_tokenization_spaces": True},
        None,
        None,
    ),
    "llama-bpe": (
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True},
        "<|begin_of_text|>",
        ["<|eot_id|>", "<|end_of_text|>"],
    ),
    "qwen2": (
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False},
        None,
        ["<|im_end|>", "<|endoftext|>"],
    ),
    "smollm": (
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "clean_up_tokenization_spaces": False},
        None,
        None,
    ),
    "starcoder": (
        ("<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>"),
        {"eos_token": "<|endoftext|>", "clean_up_tokenization_spaces": True},
        None,
        None,
    ),
}
_DS_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁hole｜>")
for _f in ("deepseek-llm", "deepseek-coder"):
    _BYTE_LEVEL_SPECIALS[_f] = (
        _DS_SPECIALS,
        {"bos_token": _DS_SPECIALS[0], "eos_token": _DS_SPECIALS[1], "clean_up_tokenization_spaces": False},
        _DS_SPECIALS[0],
        None,
    )


def byte_level_tokenizer(out: Path, family: str = "gpt-2") -> Path:
    """A byte-level BPE laid out as ``family``'s tokenizer.json, trained on :data:`CORPUS`.

    Llama-3 ignores merges for whole-word tokens and adds BOS; Qwen2 normalizes to NFC; SmolLM and StarCoder split
    digits before GPT-2's regex; DeepSeek splits with its own regex sequence.
    """
    tok = Tokenizer(models.BPE())
    if family == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _byte_level_pre(family)
    tok.decoder = decoders.ByteLevel()
    specials, cfg, bos, gen_eos = _BYTE_LEVEL_SPECIALS[family]
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    if family == "llama-bpe":
        tj = json.loads(tok.to_str())
        tj["model"]["ignore_merges"] = True
        tok = Tokenizer.from_str(json.dumps(tj))
    steps = [processors.ByteLevel(trim_offsets=False)]
    if bos is not None:
        steps.append(processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]))
    tok.post_processor = processors.Sequence(steps)
    return _save(tok, out, gen_eos, chat_template=CHATML, **cfg)


def vocab_only_gguf(model_dir: Path, out: Path, vocab_size: int | None = None, name: str = "tiny") -> Path:
    """A GGUF holding only ``model_dir``'s tokenizer as moetool writes it: ``llama_cpp.Llama(out, vocab_only=True)``."""
    import gguf

    from moetool.export.gguf.tokenizer import read_vocab, write_vocab

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(name)
    write_vocab(w, read_vocab(model_dir, vocab_size))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return out
