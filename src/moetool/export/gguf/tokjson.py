"""The parts of a fast tokenizer's ``tokenizer.json`` the GGUF vocabulary reads, as typed dicts (the file's layout).

Only the keys read are declared; the file holds more. transformers' backend writes it (``backend_tokenizer.to_str``).
"""

from __future__ import annotations

from typing import TypedDict

from moetool.io.jsontypes import JsonValue


class AddedToken(TypedDict, total=False):
    """An ``added_tokens`` entry: its id, text and whitespace flags."""

    id: int
    content: str
    special: bool
    lstrip: bool
    rstrip: bool
    single_word: bool


class TokenizerModel(TypedDict, total=False):
    """``model``: a BPE's vocabulary and merges (``"a b"`` strings, or ``["a", "b"]`` pairs in newer files)."""

    type: str
    vocab: dict[str, int]
    merges: list[str | list[str]]
    byte_fallback: bool
    ignore_merges: bool


class Normalizer(TypedDict, total=False):
    """``normalizer`` (or one step of a ``Sequence``): the steps SentencePiece-style vocabularies use."""

    type: str
    normalizers: list[Normalizer]
    prepend: str
    pattern: JsonValue
    content: str


class PreTokenizerJson(TypedDict, total=False):
    """``pre_tokenizer``: a Metaspace's settings (other kinds are only dumped, to name them)."""

    type: str
    replacement: str
    split: bool
    prepend_scheme: str


class TokenizerJson(TypedDict, total=False):
    """``tokenizer.json``: the model, the added tokens, the normalizer and the pre-tokenizer."""

    model: TokenizerModel
    added_tokens: list[AddedToken]
    normalizer: Normalizer | None
    pre_tokenizer: PreTokenizerJson | None
