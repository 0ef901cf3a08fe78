"""A byte-level BPE tokenizer trained on the zoo corpora, loadable with ``transformers.AutoTokenizer``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN)

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "UNK_TOKEN",
    "train_tokenizer",
]


def train_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    save_dir: str | Path | None = None,
    model_max_length: int = 1024,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it for ``transformers``.

    Special tokens get the ids ``<s>``=0, ``</s>``=1, ``<pad>``=2, ``<unk>``=3. Encoding with
    ``add_special_tokens=True`` (the default of ``tokenizer(text)``) puts ``<s>`` first; decoding restores the
    text byte for byte (``ByteLevel`` decoder, no prefix space added). Training is deterministic for the same
    texts and settings.

    Args:
        texts: training texts (e.g. each domain's training split).
        vocab_size: size of the vocabulary, special tokens and the 256 byte symbols included.
        min_frequency: a pair must occur this often to be merged.
        save_dir: if given, ``save_pretrained`` the tokenizer there.
        model_max_length: recorded in ``tokenizer_config.json``.
    """
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    if save_dir is not None:
        wrapped.save_pretrained(str(save_dir))
    return wrapped
