"""SentencePiece-style BPE (byte fallback, ``▁`` for spaces) from a ``tokenizer.json``, as llama.cpp's ``llama``
tokenizer model: Llama-2, Mistral v0.1-v0.3, TinyLlama, Phi-3's vocabulary.

llama.cpp's SPM tokenizer does not read merges: it repeatedly joins the adjacent pair whose concatenation is a
vocabulary entry with the highest score (the leftmost on ties). Hugging Face's BPE joins the pair of lowest merge
rank. A token's score is therefore minus the rank of the first merge that makes it, which orders llama.cpp's joins
as the merges order Hugging Face's. (llama.cpp's converter gives every token -1000 when it reads only a
tokenizer.json, which leaves the order to position alone.)
"""

from __future__ import annotations

import re

from moetool.export.base import ExportError
from moetool.export.gguf.tokjson import TokenizerJson

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_UNREACHABLE = -1e9  # a multi-character token no merge makes: joined only when nothing else can be


SPACE_LED = "text that starts with a space: transformers' Metaspace adds no '▁' before it, llama.cpp does"
AFTER_SPECIAL = "text right after a parsed special token: Metaspace(prepend_scheme='first') adds no '▁', llama.cpp does"


def space_prefix(tj: TokenizerJson, where: str, notes: list[str]) -> bool:
    """Whether text gets a leading ``▁`` (llama.cpp's ``add_space_prefix``), from the normalizer and pre-tokenizer.

    llama.cpp always writes spaces as ``▁`` and, with the prefix, puts one before every piece of text, as
    sentencepiece and the legacy ``Prepend('▁')`` normalizer do. transformers 5 rebuilds Llama-style tokenizers with
    a ``Metaspace`` pre-tokenizer instead, which skips the prefix where the text already starts with a space (and,
    with ``prepend_scheme='first'``, after special tokens): llama.cpp cannot do that, so those cases are written to
    ``notes`` (known differences) rather than refused, the rest of the text tokenizing identically.

    Raises:
        ExportError: a normalizer or pre-tokenizer step llama.cpp does not apply (named), or spaces not made ``▁``.
    """
    norm, pre = tj.get("normalizer"), tj.get("pre_tokenizer")
    steps = (norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]) if norm else []
    prefix, escaped = False, False
    for s in steps:
        if s.get("type") == "Prepend" and s.get("prepend") == "▁":
            prefix = True
        elif s.get("type") == "Replace" and s.get("pattern") == {"String": " "} and s.get("content") == "▁":
            escaped = True
        else:
            raise ExportError(f"{where}: normalizer step {s} is not one llama.cpp applies to a SentencePiece vocab")
    if pre is not None:
        if pre.get("type") != "Metaspace" or pre.get("replacement") != "▁":
            raise ExportError(f"{where}: pre-tokenizer {pre.get('type')} is not one llama.cpp's SentencePiece runs")
        if pre.get("split", True) and any("▁" in p[1:] for p in tj["model"]["vocab"]):
            # llama.cpp joins across spaces; a splitting Metaspace never does, which matters only for such tokens
            raise ExportError(f"{where}: Metaspace(split=true) with tokens that hold '▁' inside; llama.cpp joins them")
        scheme = pre.get("prepend_scheme", "always")
        if scheme != "never" and not prefix:
            prefix = True
            notes.append(SPACE_LED)
            if scheme == "first":
                notes.append(AFTER_SPECIAL)
        escaped = True
    if not escaped:
        raise ExportError(f"{where}: spaces are not written as '▁', which llama.cpp's SentencePiece tokenizer does")
    return prefix


def scores(tokens: list[str], merges: list[str], n: int) -> list[float]:
    """Minus the rank of the first merge that makes each token; 0 for single characters and bytes."""
    rank: dict[str, int] = {}
    for i, m in enumerate(merges):
        rank.setdefault(m.replace(" ", "", 1), i)
    out = [0.0] * n
    for i, t in enumerate(tokens):
        if t in rank:
            out[i] = -float(rank[t])
        elif len(t) > 1 and not _BYTE.fullmatch(t):
            out[i] = _UNREACHABLE
    return out


def token_types(tokens: list[str], types: list[int], unk: int | None) -> list[int]:
    """``types`` (normal/control/user-defined/unused) with byte tokens ``<0xNN>`` and the unknown token marked."""
    out = list(types)
    for i, t in enumerate(tokens):
        if out[i] == TOKEN_NORMAL and _BYTE.fullmatch(t):
            out[i] = TOKEN_BYTE
    if unk is not None:
        out[unk] = TOKEN_UNKNOWN
    return out


def check_bytes(tokens: list[str], where: str) -> None:
    """llama.cpp's byte fallback looks each byte up as ``<0xNN>``: all 256 must be there."""
    have = set(tokens)
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in have]
    if missing:
        raise ExportError(f"{where}: byte_fallback BPE without the byte tokens {', '.join(missing[:4])}…")
