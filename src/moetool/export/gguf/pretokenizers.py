"""llama.cpp's BPE pre-tokenizers as data, and the choice of the one that splits as a Hugging Face tokenizer does.

llama.cpp re-implements each pre-tokenizer by name (``tokenizer.ggml.pre``): a list of regexes applied one after
another, each splitting every piece the previous left (matches and the gaps between them both kept), plus flags.
Its converter picks the name by hashing the tokenization of a probe text against known models, which only knows
released vocabularies. We instead run each candidate's regexes and the tokenizer's own pre-tokenizer over probe
strings and keep the first candidate whose pieces give the same token ids with the tokenizer's own BPE model: a
behavioural match that holds for any vocabulary, fine-tunes and retrained ones included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moetool.export.base import ExportError
from moetool.export.gguf.tokjson import PreTokenizerJson, TokenizerJson

if TYPE_CHECKING:
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerBase

# the regexes as llama.cpp's llama-vocab.cpp spells them (its adapted forms, e.g. no (?i:...))
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|" + _TAIL
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + _TAIL
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DS_LETTERS = "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
_DS_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer: its regexes in order, and the vocabulary flags its name sets.

    ``ignore_merges``: a whole piece found in the vocabulary is one token (Llama-3). ``clean_spaces``: detokenizing
    drops the space before punctuation, as transformers' ``clean_up_tokenization_spaces``.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    clean_spaces: bool = True


# name → behaviour, in order of preference (names sharing a behaviour: the first is written)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "llama-bpe": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "qwen2": PreTokenizer((_QWEN2,), clean_spaces=False),
    "stablelm2": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,), clean_spaces=False),
    "gpt-2": PreTokenizer((_GPT2,)),
    "trillion": PreTokenizer((_GPT2,), clean_spaces=False),
    "starcoder": PreTokenizer((r"\p{N}", _GPT2)),
    "smollm": PreTokenizer((r"\p{N}", _GPT2), clean_spaces=False),
    "deepseek-llm": PreTokenizer(("[\r\n]", _DS_LETTERS, _DS_PUNCT, r"\s+$", _CJK, r"\p{N}+"), clean_spaces=False),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), clean_spaces=False),
}

# strings whose splits tell the pre-tokenizers apart: digit runs, contractions, case, CJK, marks, whitespace
PROBES: tuple[str, ...] = (
    "Hello world! It's 2026-11-24, 1234567 items cost $3.50; don'T WE'LL ok?",
    "def f(x):\n\treturn x**2  # square\r\n\n\n   trailing   \n",
    "naïve café Ελληνικά Привет עברית مرحبا 日本語のテキスト 中文字符 한국어 🤖🚀 e\u0301 a\u0308",
    "  leading\tspaces  and  runs    of  whitespace \u3000 full\uff01width\uff1f",
    "x=arr[i++]+0x1F;y='quoted'//c ... !!! ??? \u2018q\u2019 \u201cdq\u201d",
    "123 4567 89012 ½ ² ٣٤٥ ⅷ",
)


def _candidate_splitter(pre: PreTokenizer) -> pre_tokenizers.Sequence:
    from tokenizers import Regex, pre_tokenizers

    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _ids(model: models.Model, pieces: list[str], ignore_merges: bool, vocab: dict[str, int]) -> list[int] | None:
    """The ids of ``pieces``, or None where the vocabulary cannot spell a piece (the ids then prove nothing)."""
    out: list[int] = []
    for p in pieces:
        if ignore_merges and p in vocab:
            out.append(vocab[p])
            continue
        toks = model.tokenize(p)
        if "".join(t.value for t in toks) != p:
            return None
        out.extend(t.id for t in toks)
    return out


def _merging_model(tj: TokenizerJson) -> models.BPE:
    """The tokenizer's BPE without ignore_merges: what llama.cpp runs for a name that does not set it."""
    from tokenizers import models

    m = tj["model"]
    merges: list[tuple[str, str]] = [
        (x.split(" ", 1)[0], x.split(" ", 1)[1]) if isinstance(x, str) else (x[0], x[1]) for x in m.get("merges", [])
    ]
    return models.BPE(vocab=m["vocab"], merges=merges, ignore_merges=False)


def choose_pre_tokenizer(tok: PreTrainedTokenizerBase, tj: TokenizerJson, where: str) -> str:
    """The llama.cpp pre-tokenizer name whose splits give ``tok``'s ids on :data:`PROBES`.

    ``tok`` is the Hugging Face fast tokenizer and ``tj`` its backend's JSON. Candidates that split every probe
    into the same pieces come first, then those that only give the same ids with this vocabulary; among them, one
    whose ``clean_spaces`` matches how ``tok`` decodes is preferred (detokenization).

    Raises:
        ExportError: no ByteLevel step, or no llama.cpp pre-tokenizer gives the tokenizer's ids on the probes; the
            message names the closest candidate and the first probe where it differs.
    """
    backend = tok.backend_tokenizer
    hf_pre, model = backend.pre_tokenizer, backend.model
    if hf_pre is None or "ByteLevel" not in json.dumps(tj.get("pre_tokenizer")):
        raise ExportError(
            f"{where}: pre-tokenizer {_describe(tj.get('pre_tokenizer'))} is not one llama.cpp implements: its BPE "
            "needs byte-level pieces (a ByteLevel step) split by one of its built-in regexes"
        )
    vocab: dict[str, int] = tj["model"]["vocab"]
    ignores = bool(tj["model"].get("ignore_merges", False))
    plain = _merging_model(tj) if ignores else model
    want_pieces = [[p for p, _ in hf_pre.pre_tokenize_str(s)] for s in PROBES]
    want = [[t.id for p in ps for t in model.tokenize(p)] for ps in want_pieces]
    exact: list[str] = []  # splits every probe into the same pieces: right for any vocabulary
    agree: list[str] = []  # gives the same ids with this vocabulary (e.g. digit runs it has no tokens for)
    closest: tuple[int, str, str] = (-1, "", "")
    for name, pre in PRE_TOKENIZERS.items():
        split = _candidate_splitter(pre)
        pieces = [[p for p, _ in split.pre_tokenize_str(s)] for s in PROBES]
        flags_match = pre.ignore_merges == ignores
        m = model if flags_match else plain
        same = [
            (flags_match and ps == wp) or _ids(m, ps, pre.ignore_merges, vocab) == w
            for ps, wp, w in zip(pieces, want_pieces, want, strict=True)
        ]
        if all(same):
            (exact if pieces == want_pieces and flags_match else agree).append(name)
        elif sum(same) > closest[0]:
            closest = (sum(same), name, PROBES[same.index(False)])
    if not exact + agree:
        raise ExportError(
            f"{where}: pre-tokenizer {_describe(tj.get('pre_tokenizer'))} is not one llama.cpp implements: none of "
            f"its splitters gives the same tokens (closest: {closest[1]!r}, which differs on {closest[2]!r}; checked: "
            f"{', '.join(PRE_TOKENIZERS)})"
        )
    clean = _cleans_spaces(tok)
    return next((n for n in exact + agree if PRE_TOKENIZERS[n].clean_spaces == clean), (exact + agree)[0])


def _cleans_spaces(tok: PreTrainedTokenizerBase) -> bool:
    """Whether decoding drops the space before punctuation (transformers ignores the setting for BPE by default)."""
    ids = tok("a .", add_special_tokens=False).input_ids
    return bool(tok.decode(ids) == "a.")


def _describe(pre: PreTokenizerJson | None) -> str:
    return json.dumps(pre)[:200]
