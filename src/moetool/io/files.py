"""File names shared by every stage that copies a model's non-weight files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Everything transformers' AutoTokenizer and generate() read next to the weights: the tokenizer (fast, SentencePiece,
# and the slow BPE/WordPiece vocabularies), its special-token maps, the chat template (file or json) and the generation
# defaults. One list for every stage that copies them (merge, assemble, bake, train, package): it is the union of what
# those stages used to copy each on its own, because a file one of them left behind (a WordPiece vocab.txt, a chat
# template) made the copy load or generate differently from its source. Stages copy only the names that exist.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def copy_tokenizer(src: Path, dst: Path, *, overwrite: bool = True) -> list[str]:
    """Copy every :data:`TOKENIZER_FILES` entry that exists in ``src`` into ``dst``; returns the names copied.

    ``overwrite=False`` keeps files ``dst`` already has (a model's own re-saved tokenizer files win).
    """
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file() and (overwrite or not (Path(dst) / name).exists()):
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def tokenizer_signature(tok: PreTrainedTokenizerBase | None) -> tuple[Any, ...] | None:
    """What must match between the tokenizers of models joined into one: the vocabulary and the special tokens.
    None if there is no tokenizer."""
    if tok is None:
        return None
    return (
        tuple(sorted(tok.get_vocab().items())),
        tok.bos_token,
        tok.eos_token,
        tok.pad_token,
        tok.unk_token,
    )
