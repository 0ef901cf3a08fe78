"""Tokenizer metadata for GGUF, read from a Hugging Face fast tokenizer (its ``tokenizer.json``).

Two kinds of BPE are written, as llama.cpp's ``convert_hf_to_gguf.py`` writes them:
- byte-level BPE (GPT-2, Llama-3, Qwen2, SmolLM, DeepSeek …) as ``tokenizer.ggml.model = gpt2`` with merges and the
  llama.cpp pre-tokenizer whose splits match the tokenizer's (:mod:`.pretokenizers`);
- SentencePiece-style BPE with byte fallback (Llama-2, Mistral, TinyLlama, Phi-3) as ``llama`` with scores, byte
  tokens and ``add_space_prefix`` (:mod:`.tokenizer_spm`).
Anything llama.cpp would tokenize differently is refused with what it cannot do, rather than written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gguf import GGUFWriter
    from transformers import PreTrainedTokenizerBase

import json
from dataclasses import dataclass, field
from pathlib import Path

from moetool.export.base import ExportError
from moetool.export.gguf import tokenizer_spm as spm
from moetool.export.gguf.pretokenizers import choose_pre_tokenizer
from moetool.export.gguf.tokjson import TokenizerJson
from moetool.io.safe import read_json

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
# normalizers llama.cpp does not run but which leave already-normalized text as it is (Qwen2's NFC): accepted, so
# only text not in that form tokenizes differently (a known limit), rather than refusing the family
_IDEMPOTENT_NORMALIZERS = {"NFC"}


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
    model: str = "gpt2"  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    scores: list[float] | None = None
    add_space_prefix: bool | None = None
    eot: int | None = None  # further ids that end generation in transformers (generation_config's eos list)
    eom: int | None = None
    name_marker: str | None = None  # a word general.name must hold for llama.cpp to strip as the tokenizer does
    notes: list[str] = field(default_factory=list)


def _table(tj: TokenizerJson, where: str, vocab_size: int | None) -> tuple[list[str], list[int]]:
    """Token strings and types by id, padded with unused ``[PAD{i}]`` rows up to ``vocab_size``."""
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    for t in added.values():
        vocab[t["content"]] = t["id"]
    n = max(vocab.values()) + 1
    if vocab_size is not None and vocab_size < n:
        raise ExportError(f"{where}: {n} tokens but the model has only {vocab_size} embedding rows")
    n = max(n, vocab_size or 0)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TOKEN_UNUSED] * n  # holes and padding rows
    for piece, i in vocab.items():
        tokens[i] = piece
        types[i] = TOKEN_NORMAL
    for i, t in added.items():
        types[i] = TOKEN_CONTROL if t.get("special") else TOKEN_USER_DEFINED
    return tokens, types


def _merges(tj: TokenizerJson, where: str) -> list[str]:
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    if not merges:
        # gguf-py drops empty arrays and llama.cpp then refuses the file
        raise ExportError(f"{where}: BPE tokenizer without merges")
    return merges


def _load(model_dir: Path) -> tuple[PreTrainedTokenizerBase, TokenizerJson, str]:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{model_dir}: no tokenizer.json (a fast tokenizer is needed for GGUF metadata)")
    read_json(path, what="tokenizer", error=ExportError)  # a malformed file: an error naming it, not a traceback
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ExportError(f"{model_dir}: transformers loads a slow tokenizer here; GGUF metadata needs a fast one")
    # transformers 5 rebuilds some tokenizers from their class (LlamaTokenizer, GPT2Tokenizer): what it runs is the
    # reference, not the file
    tj: TokenizerJson = json.loads(backend.to_str())
    return tok, tj, str(path)


def read_vocab(model_dir: Path, vocab_size: int | None = None) -> GGUFVocab:
    """Everything GGUF needs to tokenize as the Hugging Face tokenizer does.

    ``vocab_size`` (the embedding rows) pads the token list with unused ``[PAD{i}]`` entries, as llama.cpp's
    converter does: llama.cpp requires one token per embedding row.

    Raises:
        ExportError: for tokenizers llama.cpp would treat differently (non-BPE models, normalizers it does not
            apply, pre-tokenizers it does not implement, missing byte tokens), each named.
    """
    tok, tj, where = _load(model_dir)
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ExportError(f"{where}: tokenizer model {model.get('type')!r}; only BPE (byte-level or byte-fallback)")
    tokens, types = _table(tj, where, vocab_size)
    merges = _merges(tj, where)
    v = _specials(tok, model_dir, tokens, types, merges)
    v.name_marker = _strip_marker(tj, tokens, v.notes, where)
    if model.get("byte_fallback"):
        spm.check_bytes(tokens, where)
        v.model, v.pre, v.merges = "llama", "default", []
        v.add_space_prefix = spm.space_prefix(tj, where, v.notes)
        v.token_types = spm.token_types(tokens, types, v.unk)
        v.scores = spm.scores(tokens, merges, len(tokens))
        return v
    norm = tj.get("normalizer")
    if norm is not None:
        if norm.get("type") not in _IDEMPOTENT_NORMALIZERS:
            raise ExportError(f"{where}: has a {norm.get('type')} normalizer, which llama.cpp's BPE does not apply")
        v.notes.append(f"llama.cpp does not apply the {norm['type']} normalizer: only {norm['type']} text matches")
    v.pre = choose_pre_tokenizer(tok, tj, where)
    return v


# llama.cpp has no per-token strip flags in GGUF; it sets them from the model's name, for one family only:
# "phi-3" → every special and added token strips whitespace on its right, except these (llama-vocab.cpp)
_PHI3_NOT_RSTRIP = ("<unk>", "<s>", "<|endoftext|>")


def _strip_marker(tj: TokenizerJson, tokens: list[str], notes: list[str], where: str) -> str | None:
    """``"phi-3"`` when the added tokens strip whitespace exactly as llama.cpp does for a model of that name.

    Raises:
        ExportError: a non-special added token strips whitespace (or is single-word), which llama.cpp never does
            and which changes how ordinary text tokenizes.
    """
    added = tj.get("added_tokens", [])
    odd = [t["content"] for t in added if not t.get("special") and (t.get("lstrip") or t.get("rstrip"))]
    odd += [t["content"] for t in added if t.get("single_word")]
    if odd:
        raise ExportError(f"{where}: added tokens {odd[:4]} strip whitespace or match whole words; llama.cpp cannot")
    if not any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    phi3 = {t["content"] for t in added if t["content"] not in _PHI3_NOT_RSTRIP} | {"</s>"}
    rstrip = {t["content"] for t in added if t.get("rstrip")}
    if rstrip == phi3 and not any(t.get("lstrip") for t in added) and set(_PHI3_NOT_RSTRIP) | {"</s>"} <= set(tokens):
        return "phi-3"
    notes.append(
        "llama.cpp ignores the lstrip/rstrip of special tokens: with special tokens parsed, whitespace next to them "
        "is kept where transformers drops it"
    )
    return None


def _end_ids(model_dir: Path, eos: int | None) -> list[int]:
    """Ids that end generation in transformers besides ``eos`` (``generation_config.json``'s list)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    ids = read_json(path, what="generation config", error=ExportError).get("eos_token_id")
    ids = ids if isinstance(ids, list) else [ids]
    return [i for i in ids if isinstance(i, int) and i != eos]


def _specials(
    tok: PreTrainedTokenizerBase, model_dir: Path, tokens: list[str], types: list[int], merges: list[str]
) -> GGUFVocab:
    """Special ids, BOS/EOS adding as the tokenizer's post-processor does it, and the chat template."""
    probe = tok("a").input_ids
    plain = tok("a", add_special_tokens=False).input_ids
    add_bos = tok.bos_token_id is not None and len(probe) > len(plain) and probe[0] == tok.bos_token_id
    add_eos = tok.eos_token_id is not None and len(probe) > len(plain) and probe[-1] == tok.eos_token_id
    extra = [i for i in _end_ids(model_dir, tok.eos_token_id) if i < len(tokens)]
    chat = getattr(tok, "chat_template", None)
    return GGUFVocab(
        pre="",
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
        eot=extra[0] if extra else None,
        eom=extra[1] if len(extra) > 1 else None,
    )


def write_vocab(writer: GGUFWriter, v: GGUFVocab) -> None:
    """The tokenizer keys; ``writer`` already holds ``general.name``, to which :attr:`GGUFVocab.name_marker` is
    added when it lacks it."""
    if v.name_marker:
        name = writer.kv_data[0].get("general.name")
        old = str(name.value) if name is not None else ""
        if v.name_marker not in old.lower():
            writer.kv_data[0].pop("general.name", None)  # replaced, not duplicated (gguf-py warns on duplicates)
            writer.add_name(f"{old} ({v.name_marker} vocabulary)".strip())
    writer.add_tokenizer_model(v.model)
    writer.add_tokenizer_pre(v.pre)
    writer.add_token_list(v.tokens)
    if v.scores is not None:
        writer.add_token_scores(v.scores)
    writer.add_token_types(v.token_types)
    if v.merges:
        writer.add_token_merges(v.merges)
    for setter, value in (
        (writer.add_bos_token_id, v.bos),
        (writer.add_eos_token_id, v.eos),
        (writer.add_pad_token_id, v.pad),
        (writer.add_unk_token_id, v.unk),
        (writer.add_eot_token_id, v.eot),
        (writer.add_eom_token_id, v.eom),
    ):
        if value is not None:
            setter(value)
    writer.add_add_bos_token(v.add_bos)
    writer.add_add_eos_token(v.add_eos)
    if v.add_space_prefix is not None:
        writer.add_add_space_prefix(v.add_space_prefix)
    if v.chat_template:
        writer.add_chat_template(v.chat_template)


def llama_cpp_equivalent(v: GGUFVocab, text: str) -> str:
    """The text whose transformers ids llama.cpp gives for ``text`` (plain text, no special tokens): ``text`` itself,
    or ``' ' + text`` where it starts with a space and transformers' Metaspace skips the '▁' that llama.cpp (as
    sentencepiece) adds (:data:`tokenizer_spm.SPACE_LED` in ``v.notes``). For a parity check that tells that known
    difference from a wrong vocabulary."""
    return " " + text if spm.SPACE_LED in v.notes and text.startswith(" ") else text
