"""File names shared by every stage that copies a model's non-weight files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from moetool.io.hashes import sha256_file
from moetool.io.safe import read_json

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


def tokenizer_signature(tok: PreTrainedTokenizerBase | None) -> tuple[object, ...] | None:
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


MOETOOL_META = "moetool.json"  # what moetool writes into every model folder it builds: method, provenance, layout
BUNDLE_LAYOUT = "bundle"  # moetool.json's ``layout`` for a method output that is no single transformers model


def is_bundle(folder: Path) -> bool:
    """Whether ``folder`` is a method bundle: a moetool output that is several models and files behind a router
    rather than one transformers model (GEM's sequence level, hybrid), marked by ``"layout": "bundle"`` in its
    ``moetool.json``. A bundle is exported and packaged whole.

    The marker is explicit, so a model folder that merely lost its ``config.json`` is never taken for one.
    """
    meta = Path(folder) / MOETOOL_META
    if (Path(folder) / "config.json").is_file() or not meta.is_file():
        return False
    return bool(read_json(meta, what="moetool metadata").get("layout") == BUNDLE_LAYOUT)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files that are a model folder's weights, sorted: its own (top level) for a transformers model
    folder; every one in the tree for a bundle (GEM's pathways, hybrid's router)."""
    folder = Path(folder)
    return sorted(folder.rglob("*.safetensors") if is_bundle(folder) else folder.glob("*.safetensors"))


def weights_sha256(folder: Path) -> dict[str, str]:
    """sha256 of each of :func:`weight_files`, by its path relative to ``folder`` (``model.safetensors``,
    ``pathways/code/model.safetensors``): what an export's manifest records and packaging compares."""
    return {f.relative_to(folder).as_posix(): sha256_file(f) for f in weight_files(folder)}
