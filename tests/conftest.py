"""Tiny checkpoints built from configs: no network, a few milliseconds each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

TEXT = (
    "def main(): import os; return os.path.join('a', 'b')\n"
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software.\n"
    "Cholera due to Vibrio cholerae; acute bronchitis; fracture of the femur; diabetes mellitus.\n"
) * 4


def make_tokenizer(out: Path) -> None:
    """A small byte-level BPE tokenizer with BOS prepended, saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(str(out))


VOCAB = 320  # >= the tokenizer's size


def dense_config(family: str = "llama", **kw: object) -> object:
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        common["head_dim"] = 8
    common.update(kw)
    cls = {
        "llama": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "granite": "GraniteConfig",
    }[family]
    return getattr(transformers, cls)(**common)


def save_dense(
    out: Path,
    family: str = "llama",
    seed: int = 0,
    base: Path | None = None,
    mlp_noise: float = 0.0,
    **kw: object,
) -> Path:
    """Save a tiny dense model; with ``base``, copy its weights and perturb only the MLPs (an 'expert')."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mlp." in name:
                    p.add_(torch.randn_like(p) * mlp_noise)
    else:
        model = AutoModelForCausalLM.from_config(dense_config(family, **kw), dtype=torch.float32)
        with torch.no_grad():  # bigger weights than the default init, so differences show in the logits
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.2)
                elif "bias" in name:
                    p.normal_(0, 0.1)
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Path]]:
    """``tiny_models(family)`` → {'base', 'e1', 'e2', 'e3'} dirs (cached per family)."""
    cache: dict[str, dict[str, Path]] = {}

    def build(family: str) -> dict[str, Path]:
        if family not in cache:
            root = tmp_path_factory.mktemp(f"tiny-{family}")
            base = save_dense(root / "base", family)
            cache[family] = {"base": base} | {
                f"e{i}": save_dense(root / f"e{i}", family, seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)
            }
        return cache[family]

    return build


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
