"""A 2-layer Llama sized to a trained test tokenizer, shared by the evaluation tests."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(tok: Any, seed: int = 0) -> LlamaForCausalLM:
    """Random weights from ``seed``; vocabulary and special ids from ``tok``; in eval mode."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(cfg).eval()
