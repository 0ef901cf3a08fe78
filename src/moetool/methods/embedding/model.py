"""``moetool_routed_embedding``: any causal LM (dense llama family or a merged Mixtral/Qwen MoE) with a routed
embedding in place of its input embedding table.

The body is the wrapped model's base model (``AutoModel``, e.g. ``LlamaModel``) called with ``inputs_embeds``; its
own ``embed_tokens`` is dropped, so it is neither stored nor loaded. The output head is an explicit choice:

- ``head: keep``: a separate V×D head, initialised from the original head (the original embedding when it was tied);
- ``head: seed``: tied to the seed table through the projection, ``logits = (h W) E_seedᵀ`` (ALBERT-style), so the
  V×D matrix disappears; not for ``selection``, whose table is not in seed space.

Saved with ``save_pretrained`` as safetensors; loaded with ``AutoModelForCausalLM`` once this package is imported
(``moetool.methods`` imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from moetool.methods.base import register_causal_lm
from moetool.methods.embedding.router import causal_mask
from moetool.methods.embedding.variants import EmbeddingConfig, RoutedEmbedding

MODEL_TYPE = "moetool_routed_embedding"
HEADS = ("keep", "seed")


class RoutedEmbeddingConfig(PretrainedConfig):
    """``body``: the wrapped model's config dict; ``embedding``: :class:`EmbeddingConfig` as a dict; ``head``."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        body: dict[str, Any] | None = None,  # splatted into AutoConfig.for_model
        embedding: dict[str, Any] | None = None,  # splatted into EmbeddingConfig
        head: str = "keep",
        **kwargs: Any,
    ) -> None:
        self.body = dict(body or {})
        self.embedding = dict(embedding or {})
        self.head = head
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
            if key in self.body:
                setattr(self, key, self.body[key])
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs.setdefault(key, self.body.get(key))
        kwargs["tie_word_embeddings"] = False  # tying is the explicit ``head`` option, not transformers'
        super().__init__(**kwargs)


@dataclass
class DecodeState:
    """Caches of one running generation: the body's transformers cache and the router's tensors."""

    body: Cache
    router: tuple[torch.Tensor, ...]
    length: int


class RoutedEmbeddingForCausalLM(PreTrainedModel):
    config_class = RoutedEmbeddingConfig
    base_model_prefix = "body"
    _no_split_modules: list[str] = []  # noqa: RUF012  (transformers declares these per instance)

    def __init__(self, config: RoutedEmbeddingConfig) -> None:
        super().__init__(config)
        if config.head not in HEADS:
            raise ValueError(f"head {config.head!r}: expected one of {', '.join(HEADS)}")
        body_cfg = AutoConfig.for_model(**config.body)
        body_cfg.tie_word_embeddings = False
        self.body = AutoModel.from_config(body_cfg)
        self.body.embed_tokens = None  # replaced by self.embed; keeping it would store the table we remove
        ecfg = EmbeddingConfig(**config.embedding)
        if ecfg.d_model != body_cfg.hidden_size or ecfg.vocab_size != body_cfg.vocab_size:
            raise ValueError(
                f"embedding: d_model/vocab_size {ecfg.d_model}/{ecfg.vocab_size} do not match the body's "
                f"{body_cfg.hidden_size}/{body_cfg.vocab_size}"
            )
        if config.head == "seed" and ecfg.variant == "selection":
            raise ValueError("head: 'seed' needs a seed table; the selection variant's pool table is not one")
        self.embed = RoutedEmbedding(ecfg)
        self.lm_head = nn.Linear(ecfg.d_model, ecfg.vocab_size, bias=False) if config.head == "keep" else None
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Every part initialises itself (the body from its config, the embedding in its constructor)."""

    @property
    def model(self) -> nn.Module:
        """The body under the name moetool's tools look for (``model.model.layers``: eval, router taps)."""
        body: nn.Module = self.body
        return body

    def get_input_embeddings(self) -> nn.Module:
        return self.embed.table

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, D] → [B, T, V] through the chosen head."""
        if self.lm_head is not None:
            out: torch.Tensor = self.lm_head(hidden)
            return out
        return (hidden @ self.embed.proj.weight) @ self.embed.table.weight.T

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any
    ) -> CausalLMOutputWithPast:
        """Whole-sequence forward: ids [B, T] → logits [B, T, V]; ``loss`` is the LM loss when ``labels`` are given.

        The routed embedding cannot see an attention mask: it reads every position's prefix, so pad on the right.
        ``aux_loss`` on the output carries the router's weighted auxiliary losses.
        """
        mask = kwargs.get("attention_mask")
        if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("attention_mask: the routed embedding reads every prefix; pad on the right, not the left")
        b, t = input_ids.shape
        self._check_length(t)
        pos = torch.arange(t, device=input_ids.device)[None].expand(b, t)
        x, _, aux = self.embed(input_ids, pos, causal_mask(t, 0, b).to(input_ids.device))
        h = self.body(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state
        logits = self.logits(h)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        out["aux_loss"] = aux["total"]
        out["embeds"] = x
        return out

    def _check_length(self, n: int) -> None:
        limit = self.embed.cfg.max_positions
        if n > limit:
            raise ValueError(f"sequence of {n} tokens: the router has positions for {limit} (max_positions)")

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, state: DecodeState | None = None) -> tuple[torch.Tensor, DecodeState]:
        """Cached forward of new tokens ids [B, T] after ``state`` (None: a fresh prompt) → (logits [B, T, V], state).

        The router runs on the new tokens only, against its cached keys and values: O(1) router work per token.
        """
        from transformers import DynamicCache

        b, t = input_ids.shape
        p = 0 if state is None else state.length
        self._check_length(p + t)
        pos = (torch.arange(t, device=input_ids.device) + p)[None].expand(b, t)
        x, router_cache, _ = self.embed(
            input_ids, pos, causal_mask(t, p, b).to(input_ids.device), () if state is None else state.router
        )
        cache = DynamicCache(config=self.body.config) if state is None else state.body
        out = self.body(inputs_embeds=x, position_ids=pos, past_key_values=cache, use_cache=True)
        return self.logits(out.last_hidden_state), DecodeState(out.past_key_values, router_cache, p + t)

    @torch.no_grad()
    def greedy(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with both caches: ids [B, T] → [B, T + max_new_tokens]."""
        logits, state = self.step(input_ids)
        out = [input_ids]
        for _ in range(max_new_tokens):
            nxt = logits[:, -1:].argmax(-1)
            out.append(nxt)
            logits, state = self.step(nxt, state)
        return torch.cat(out, dim=1)


def register() -> None:
    """Make ``AutoConfig``/``AutoModelForCausalLM`` load ``moetool_routed_embedding`` directories."""

    register_causal_lm(RoutedEmbeddingConfig, RoutedEmbeddingForCausalLM)


# importing this module is enough to load its checkpoints through the Auto classes
register()
