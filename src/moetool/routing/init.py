"""Router weight initialisation from prompts (MoFE): hidden states, token embeddings, or random.

Every function returns raw router rows; a row's dot product with the router input is that expert's logit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from moetool.routing.tap import moe_block

PromptSet = tuple[Sequence[str], Sequence[str]]  # (positive, negative)


def normalise_rows(v: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """L2-normalise the last dimension. ``v``: ``[..., H]``."""
    result: torch.Tensor = v / v.norm(dim=-1, keepdim=True).clamp_min(eps)
    return result


def _prompt_texts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], chat_template: bool) -> list[str]:
    if not chat_template:
        return list(prompts)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template: true, but the base tokenizer has no chat template")
    return [
        str(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=False)
        )
        for p in prompts
    ]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], *, chat_template: bool = False
) -> dict[str, torch.Tensor]:
    """Tokenize prompts right-padded, with ``content_mask`` marking the tokens that count.

    Padding and special tokens (BOS, template markers) are excluded: their states are shared by every prompt and
    carry no domain signal.

    Returns:
        ``input_ids``, ``attention_mask`` and ``content_mask``, each ``[P, T]``.

    Raises:
        ValueError: a prompt has no content tokens.
    """
    texts = _prompt_texts(tokenizer, prompts, chat_template)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    limit = getattr(tokenizer, "model_max_length", None)
    cut = {"truncation": True, "max_length": int(limit)} if isinstance(limit, int) and limit < 10**9 else {}
    encoded = [tokenizer(t, add_special_tokens=not chat_template, **cut)["input_ids"] for t in texts]
    width = max(len(ids) for ids in encoded)
    ids = torch.full((len(encoded), width), pad_id if pad_id is not None else 0, dtype=torch.long)
    attn = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, seq in enumerate(encoded):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    content = attn.bool() & ~torch.isin(ids, special)
    for i, p in enumerate(prompts):
        if not content[i].any():
            raise ValueError(f"prompt {p!r} has no tokens other than special tokens")
    return {"input_ids": ids, "attention_mask": attn, "content_mask": content}


@torch.inference_mode()
def mlp_input_means(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    chat_template: bool = False,
    batch_size: int = 16,
) -> torch.Tensor:
    """Mean router input per layer over prompts.

    The router input is what each decoder layer's feed-forward block receives (the post-attention RMSNorm output),
    captured with forward pre-hooks: the dense MLP of a base, or the MoE block of a merged model. Each prompt's states are averaged over its content tokens, then prompts are averaged with equal
    weight.

    Returns:
        ``[L, H]`` float32.
    """
    layers = model.model.layers
    captured: list[torch.Tensor] = []

    def hook(_mod: Any, args: tuple[torch.Tensor, ...]) -> None:
        captured.append(args[0].float())

    device = next(model.parameters()).device

    blocks = [moe_block(layer) for layer in layers]
    handles = [b.register_forward_pre_hook(hook) for b in blocks if b is not None]
    sums = torch.zeros(len(layers), model.config.hidden_size)
    try:
        for start in range(0, len(prompts), batch_size):
            enc = encode_prompts(tokenizer, prompts[start : start + batch_size], chat_template=chat_template)
            captured.clear()
            ids, attn = enc["input_ids"].to(device), enc["attention_mask"].to(device)
            model(input_ids=ids, attention_mask=attn, use_cache=False)
            mask = enc["content_mask"].unsqueeze(-1).float().to(device)  # [P, T, 1]
            for li, h in enumerate(captured):  # h: [P, T, H]
                per_prompt = (h * mask).sum(1) / mask.sum(1)  # [P, H]
                sums[li] += per_prompt.sum(0).cpu()
    finally:
        for handle in handles:
            handle.remove()
    return sums / len(prompts)


def hidden_gates(
    model: Any, tokenizer: PreTrainedTokenizerBase, prompt_sets: Sequence[PromptSet], *, chat_template: bool = False
) -> torch.Tensor:
    """MoFE router rows from the router's own inputs: mean(positive) − mean(negative), L2-normalised per layer.

    Returns:
        ``[L, E, H]`` float32.
    """
    rows = []
    for pos, neg in prompt_sets:
        v = mlp_input_means(model, tokenizer, pos, chat_template=chat_template)
        if neg:
            v = v - mlp_input_means(model, tokenizer, neg, chat_template=chat_template)
        rows.append(v)
    gates = normalise_rows(torch.stack(rows, dim=1))
    warn_degenerate(gates)
    return gates


def cheap_embed_gates(
    embed: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase,
    prompt_sets: Sequence[PromptSet],
    num_layers: int,
    *,
    chat_template: bool = False,
) -> torch.Tensor:
    """Router rows from input token embeddings alone (no forward pass), the same row in every layer.

    Args:
        embed: the embedding table ``[V, H]``.

    Returns:
        ``[L, E, H]`` float32.
    """

    def mean(prompts: Sequence[str]) -> torch.Tensor:
        enc = encode_prompts(tokenizer, prompts, chat_template=chat_template)
        mask = enc["content_mask"].unsqueeze(-1).float()
        vecs = embed.float()[enc["input_ids"]]  # [P, T, H]
        return ((vecs * mask).sum(1) / mask.sum(1)).mean(0)

    rows = []
    for pos, neg in prompt_sets:
        v = mean(pos)
        if neg:
            v = v - mean(neg)
        rows.append(v)
    gates = normalise_rows(torch.stack(rows)).unsqueeze(0).expand(num_layers, -1, -1).contiguous()
    warn_degenerate(gates)
    return gates


def random_gates(num_layers: int, num_experts: int, hidden: int, *, seed: int) -> torch.Tensor:
    """Gaussian router rows with std 1/sqrt(H) (the scale of ``nn.Linear``'s default init), seeded.

    Returns:
        ``[L, E, H]`` float32.
    """
    g = torch.Generator().manual_seed(seed)
    result: torch.Tensor = torch.randn(num_layers, num_experts, hidden, generator=g) / hidden**0.5
    return result


def warn_degenerate(gates: torch.Tensor, threshold: float = 0.98) -> None:
    """Warn when two experts' rows are almost parallel in every layer: the router cannot tell them apart."""
    if gates.shape[1] < 2:
        return
    sim = gates @ gates.transpose(1, 2)  # [L, E, E]
    e = gates.shape[1]
    off = sim[:, ~torch.eye(e, dtype=torch.bool)].reshape(gates.shape[0], -1)
    if bool((off.max(dim=1).values > threshold).all()):
        warnings.warn(
            f"router rows of some experts have cosine similarity > {threshold} in every layer; their prompts do "
            "not separate them (use more distinctive or negative prompts)",
            stacklevel=2,
        )
