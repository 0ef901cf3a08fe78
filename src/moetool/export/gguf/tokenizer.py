"""Tokenizer metadata for GGUF, read from a Hugging Face ``tokenizer.json`` (byte-level BPE).

llama.cpp re-implements each pre-tokenizer by name (``tokenizer.ggml.pre``), so the split rules must be one it
knows: we recognise the forms below and refuse anything else rather than write a file that tokenizes differently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetool.export.base import ExportError
from moetool.io.safe import read_json

# tokenizer.json Split regexes (followed by ByteLevel without its own regex) → llama.cpp pre-tokenizer name
_SPLIT_PRE: dict[str, str] = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


@dataclass
class GGUFVocab:
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos: int | None
    eos: int | None
    pad: int | None
    unk: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def _pre_tokenizer(pre: dict[str, Any] | None, where: Path) -> str:
    def byte_level(p: dict[str, Any]) -> bool:
        return p.get("type") == "ByteLevel" and not p.get("add_prefix_space", False)

    if pre is None:
        raise ExportError(f"{where}: no pre_tokenizer; llama.cpp's BPE needs one of its known splitters")
    if byte_level(pre) and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        if (
            len(parts) == 2
            and parts[0].get("type") == "Split"
            and byte_level(parts[1])
            and not parts[1].get("use_regex", True)
        ):
            regex = parts[0].get("pattern", {}).get("Regex")
            if regex in _SPLIT_PRE:
                return _SPLIT_PRE[regex]
    raise ExportError(
        f"{where}: pre-tokenizer {json.dumps(pre)[:200]} is not one llama.cpp implements; supported: ByteLevel "
        f"(GPT-2 regex, no prefix space) or a Split with the {', '.join(sorted(set(_SPLIT_PRE.values())))} regex"
    )


def read_vocab(model_dir: Path, vocab_size: int | None = None) -> GGUFVocab:
    """Everything GGUF needs to tokenize as the Hugging Face tokenizer does.

    ``vocab_size`` (the embedding rows) pads the token list with unused ``[PAD{i}]`` entries, as llama.cpp's
    converter does: llama.cpp requires one token per embedding row.

    Raises:
        ExportError: for tokenizers llama.cpp would treat differently (non-BPE models, normalizers,
            unknown pre-tokenizers, prefix spaces).
    """
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{model_dir}: no tokenizer.json (a fast tokenizer is needed for GGUF metadata)")
    tj = read_json(path, what="tokenizer", error=ExportError)
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ExportError(f"{path}: tokenizer model {model.get('type')!r}; only byte-level BPE is supported")
    if tj.get("normalizer") is not None:
        raise ExportError(f"{path}: has a normalizer, which llama.cpp's BPE does not apply")
    if model.get("byte_fallback"):
        raise ExportError(f"{path}: byte_fallback BPE (SentencePiece style) is not supported yet")
    pre = _pre_tokenizer(tj.get("pre_tokenizer"), path)

    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in tj.get("added_tokens", [])}
    for content, t in added.items():
        vocab[content] = t["id"]
    n = max(vocab.values()) + 1
    if vocab_size is not None and vocab_size < n:
        raise ExportError(f"{path}: {n} tokens but the model has only {vocab_size} embedding rows")
    n = max(n, vocab_size or 0)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TOKEN_UNUSED] * n  # holes and padding rows
    for piece, i in vocab.items():
        tokens[i] = piece
        types[i] = TOKEN_NORMAL
    for t in added.values():
        types[t["id"]] = TOKEN_CONTROL if t.get("special") else TOKEN_USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:
        # gguf-py drops empty arrays and llama.cpp then refuses the file
        raise ExportError(f"{path}: BPE tokenizer without merges")

    from transformers import AutoTokenizer

    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
    probe = tok("a").input_ids
    plain = tok("a", add_special_tokens=False).input_ids
    add_bos = tok.bos_token_id is not None and len(probe) > len(plain) and probe[0] == tok.bos_token_id
    add_eos = tok.eos_token_id is not None and len(probe) > len(plain) and probe[-1] == tok.eos_token_id
    chat = getattr(tok, "chat_template", None)
    return GGUFVocab(
        pre=pre,
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos=tok.bos_token_id,
        eos=tok.eos_token_id,
        pad=tok.pad_token_id,
        unk=tok.unk_token_id,
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=chat if isinstance(chat, str) else None,
    )


def write_vocab(writer: Any, v: GGUFVocab) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(v.pre)
    writer.add_token_list(v.tokens)
    writer.add_token_types(v.token_types)
    writer.add_token_merges(v.merges)
    for setter, value in (
        (writer.add_bos_token_id, v.bos),
        (writer.add_eos_token_id, v.eos),
        (writer.add_pad_token_id, v.pad),
        (writer.add_unk_token_id, v.unk),
    ):
        if value is not None:
            setter(value)
    writer.add_add_bos_token(v.add_bos)
    writer.add_add_eos_token(v.add_eos)
    if v.chat_template:
        writer.add_chat_template(v.chat_template)
