"""Tiny experts for the hybrid tests: a llama (conftest's) and a Mamba with the same tokenizer, built from configs."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import TEXT, VOCAB, make_tokenizer, save_dense


def save_mamba(out: Path, seed: int = 0, hidden: int = 16, layers: int = 2, vocab: int = VOCAB) -> Path:
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    cfg = MambaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        state_size=4,
        num_hidden_layers=layers,
        expand=2,
        conv_kernel=4,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    model = MambaForCausalLM(cfg)
    with torch.no_grad():  # bigger weights than the default init so the experts differ visibly
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embeddings" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return out


def save_pair(root: Path) -> tuple[Path, Path]:
    """(llama dir, mamba dir) sharing conftest's tokenizer."""
    return save_dense(root / "llama", "llama", max_position_embeddings=256), save_mamba(root / "mamba")


def write_texts(root: Path) -> dict[str, Path]:
    """Two small 'domains' of text, documents separated by blank lines (train.data text sources)."""
    lines = TEXT.strip().splitlines()
    out = {}
    for i, name in enumerate(("alpha", "beta")):
        docs = []
        for j in range(40):
            pick = (
                [lines[(i + j + k) % len(lines)] for k in range(3)] if i == 0 else [lines[(j * 2 + 1) % len(lines)]] * 2
            )
            docs.append(" ".join(pick) + f" item {j}")
        p = root / f"{name}.txt"
        p.write_text("\n\n".join(docs))
        out[name] = p
    return out
