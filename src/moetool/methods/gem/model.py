"""``moetool_gem``: the token-level GEM model as a transformers model class.

One llama-architecture general model whose every layer holds the general FFN plus one FFN per domain (the domain
experts' own MLPs), and a router that picks one of them per token:

1. encoder: the general model's first ``encoder_layers`` layers (general FFNs) give h [B, T, D]; e = h / rms(h)
   (``router_context: prefix``: then the causal running mean of e, so a token is routed by its document so far).
2. P(d|x_t) = softmax(W_r · e_t + b) over the domains [B, T, n_domains].
3. route_t = argmax_d P + 1 if max_d P > tau (strict), else 0 (general). Hard top-1, "general" outside the softmax.
4. the full pass: every layer uses route_t's FFN for token t (attention, norms, embeddings: the general model's).

Optional SCAR: each layer's attention is restricted to same-cluster tokens (fixed per-layer centroids, see scar.py).
No KV cache: every call recomputes the whole prefix (fine for these small models; ``generate`` works with
``use_cache=False``). Parameter names: the general FFN keeps the dense names (``model.layers.i.mlp.gate_proj``),
pathway d is ``model.layers.i.mlp.pathways.d.*``, the router ``model.router``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from moetool.methods.base import register_causal_lm
from moetool.methods.gem.scar import assign_clusters, scar_mask

MODEL_TYPE = "moetool_gem"


class GemConfig(LlamaConfig):
    """A llama config plus the GEM fields."""

    model_type = MODEL_TYPE
    domains: list[str] | None = None  # pathway names in order; route d+1 is domains[d]
    tau: float = 0.7
    encoder_layers: int = 1
    scar_clusters: int = 0  # 0: full causal attention
    router_context: str = "token"  # token: e(x_t); prefix: causal running mean of e over positions ≤ t


def decide(probs: torch.Tensor, tau: float) -> torch.Tensor:
    """The GEM rule on P(d|x) ``[..., n]``: argmax + 1 where max P > tau (strict), else 0 (general) → ``[...]``."""
    maxp, arg = probs.max(-1)
    return torch.where(maxp > tau, arg + 1, torch.zeros_like(arg))


def rms_features(h: torch.Tensor) -> torch.Tensor:
    """e = h / rms(h) over the last dim (no learned scale): the router sees directions, not the residual's size."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def prefix_mean(e: torch.Tensor) -> torch.Tensor:
    """Causal running mean over the sequence: out[:, t] = mean(e[:, :t+1]); e [B, T, D] → [B, T, D]."""
    n = torch.arange(1, e.shape[1] + 1, device=e.device, dtype=e.dtype)[None, :, None]
    return e.cumsum(1) / n


class GemMLP(LlamaMLP):
    """The general FFN (inherited projections) plus ``pathways[d]``, one FFN per domain, applied per token."""

    def __init__(self, config: GemConfig) -> None:
        super().__init__(config)
        self.pathways = nn.ModuleList([LlamaMLP(config) for _ in config.domains or []])

    def forward(self, x: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D], route [B, T] (0 general, d+1 pathway d; None: all general) → [B, T, D]."""
        general = super().forward
        if route is None:
            result: torch.Tensor = general(x)
            return result
        flat, r = x.reshape(-1, x.shape[-1]), route.reshape(-1)
        out = torch.zeros_like(flat)
        for p, fn in enumerate([general, *self.pathways]):
            idx = (r == p).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_copy(0, idx, fn(flat[idx]))
        return out.view_as(x)


@dataclass
class GemOutput(CausalLMOutputWithPast):
    """Causal LM output plus the routing: ``router_probs`` [B, T, n_domains], ``routes`` [B, T] (0 = general)."""

    router_probs: torch.Tensor | None = None
    routes: torch.Tensor | None = None


class GemModel(LlamaPreTrainedModel):
    config_class = GemConfig

    def __init__(self, config: GemConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        for layer in self.layers:
            layer.mlp = GemMLP(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.router = nn.Linear(config.hidden_size, len(config.domains or []), bias=True)
        if config.scar_clusters:
            # per layer, fitted on calibration text (methods/gem/pathways.py); a parameter so it is saved and loaded
            shape = (config.num_hidden_layers, config.scar_clusters, config.hidden_size)
            self.scar_centroids = nn.Parameter(torch.zeros(shape), requires_grad=False)
        self.post_init()

    def _layer(
        self, i: int, x: torch.Tensor, pe: Any, causal: torch.Tensor, route: torch.Tensor | None
    ) -> torch.Tensor:
        layer: Any = self.layers[i]
        h = layer.input_layernorm(x)
        mask = causal
        if self.config.scar_clusters:
            mask = scar_mask(assign_clusters(h, self.scar_centroids[i]), dtype=h.dtype)
        a, _ = layer.self_attn(hidden_states=h, position_embeddings=pe, attention_mask=mask)
        x = x + a
        result: torch.Tensor = x + layer.mlp(layer.post_attention_layernorm(x), route)
        return result

    def encode(self, x: torch.Tensor, pe: Any, causal: torch.Tensor) -> torch.Tensor:
        """Router features e [B, T, D]: the general model's first ``encoder_layers`` layers, RMS-normalised."""
        h = x
        for i in range(self.config.encoder_layers):
            h = self._layer(i, h, pe, causal, None)
        e = rms_features(h)
        return prefix_mean(e) if self.config.router_context == "prefix" else e

    def forward(
        self,
        input_ids: torch.Tensor,
        tau: float | None = None,
        route: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids [B, T] → (last hidden [B, T, D] after the final norm, router probs [B, T, n], routes [B, T]).

        ``tau`` overrides the config's threshold; ``route`` forces the routes (the router still runs).
        """
        x = self.embed_tokens(input_ids)
        t = input_ids.shape[1]
        pos = torch.arange(t, device=x.device)[None]
        pe = self.rotary_emb(x, pos)
        causal = torch.full((t, t), float("-inf"), dtype=x.dtype, device=x.device).triu(1)[None, None]
        probs = torch.softmax(self.router(self.encode(x, pe, causal)).float(), dim=-1)
        if route is None:
            route = decide(probs, self.config.tau if tau is None else tau)
        for i in range(len(self.layers)):
            x = self._layer(i, x, pe, causal, route)
        return self.norm(x), probs, route


class GemForCausalLM(LlamaPreTrainedModel):
    config_class = GemConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # noqa: RUF012  (transformers declares these per instance)

    def __init__(self, config: GemConfig) -> None:
        super().__init__(config)
        self.model = GemModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        result: torch.nn.Module = self.model.embed_tokens
        return result

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        tau: float | None = None,
        route: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> GemOutput:
        """input_ids [B, T] → logits [B, T, V], router_probs [B, T, n], routes [B, T]; loss if ``labels``.

        Padding is not supported (``attention_mask`` must be all ones): a padded batch would route pad tokens.
        """
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("moetool_gem does not support padded batches (attention_mask with zeros)")
        h, probs, routes = self.model(input_ids, tau=tau, route=route)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1)
            )
        return GemOutput(loss=loss, logits=logits, router_probs=probs, routes=routes)


def register() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` load ``moetool_gem`` checkpoints (idempotent)."""

    register_causal_lm(GemConfig, GemForCausalLM)


# importing this module is enough to load its checkpoints through the Auto classes
register()
