"""GEM's traceable graphs, built from the graph exporters' parts (:mod:`moetool.export.graph.model`).

- :class:`GemGraph`: the token-level model with the router, the threshold rule and the pathway choice inside it.
  Every pathway's FFN runs on every token and the one-hot route weights the sum (no data-dependent shapes), so the
  graph computes (n + 1) FFNs per token. With SCAR the cluster assignment and the same-cluster mask are in the
  graph too.
- :class:`RouterGraph`: the sequence-level router (the general model's first layers, mean pool, W_r, the rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

import torch
from torch import nn

from moetool.errors import MoetoolError
from moetool.export.graph.common import onnx_export
from moetool.export.graph.model import NEG, Attention, GatedMLP, RMSNorm, attend, causal_mask, linear, qkv_rope
from moetool.export.graph.precision import graph_precision
from moetool.quant.plan import TensorEntry, parse_quant, resolve
from moetool.quant.roles import Role

__all__ = ["GemGraph", "RouterGraph", "graph_precisions", "trace_onnx"]

GRAPH_INPUTS = ["input_ids", "position_ids", "mask"]


def _ffn(mlp: Any) -> GatedMLP:
    return GatedMLP(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


class _Layer(nn.Module):
    """One decoder layer's parts; the graphs run them themselves (GEM's masks and pathway mix sit in between)."""

    def __init__(self, layer: Any, cfg: PretrainedConfig) -> None:
        super().__init__()
        eps = float(cfg.rms_norm_eps)
        self.attn_norm = RMSNorm(layer.input_layernorm.weight, eps)
        self.attn = Attention(layer.self_attn, cfg, eps)
        self.ffn_norm = RMSNorm(layer.post_attention_layernorm.weight, eps)
        self.mlp = _ffn(layer.mlp)
        self.pathways = nn.ModuleList([_ffn(p) for p in getattr(layer.mlp, "pathways", [])])


def _rope(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[B, 1, T, head_dim]`` of ``position_ids`` ``[B, T]``."""
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _rule(probs: torch.Tensor, tau: float) -> torch.Tensor:
    """GEM's rule on router probabilities ``[..., n]``: argmax + 1 where the max is strictly above ``tau``, else
    0 (general)."""
    if probs.shape[-1] == 1:
        # one domain: its probability and index 0, as max would give; LiteRT's converter cannot legalize the
        # (value, index) reduce of max(-1) over a single element, so a one-domain GEM's TFLite graph would not convert
        maxp, arg = probs[..., 0], torch.zeros_like(probs[..., 0], dtype=torch.long)
    else:
        maxp, arg = probs.max(-1)
    return torch.where(maxp > tau, arg + 1, torch.zeros_like(arg))


class GemGraph(nn.Module):
    """The token-level GEM model as a traceable graph: ``forward(input_ids, position_ids, mask)`` →
    (logits [B, T, V], router_probs [B, T, n], routes [B, T] int64)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        cfg = model.config
        gm = model.model
        self.tau = float(cfg.tau)
        self.encoder_layers = int(cfg.encoder_layers)
        self.embed = nn.Embedding.from_pretrained(gm.embed_tokens.weight.detach().clone(), freeze=True)
        self.layers = nn.ModuleList([_Layer(layer, cfg) for layer in gm.layers])
        self.norm = RMSNorm(gm.norm.weight, float(cfg.rms_norm_eps))
        self.lm_head = linear(model.lm_head.weight)
        self.router = linear(gm.router.weight, gm.router.bias)
        self.n_paths = len(cfg.domains) + 1
        self.prefix = cfg.router_context == "prefix"
        self.scar = int(cfg.scar_clusters)
        if self.scar:
            self.register_buffer("centroids", gm.scar_centroids.detach().clone())
        self.register_buffer("inv_freq", gm.rotary_emb.inv_freq.detach().clone().float(), persistent=False)

    def _mask(self, i: int, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not self.scar:
            return mask
        c: torch.Tensor = self.centroids[i]  # type: ignore[index]
        hn = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        cn = c / c.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        lab = torch.matmul(hn, cn.transpose(0, 1)).argmax(-1)  # [B, T]
        same = (lab[:, :, None] == lab[:, None, :])[:, None]
        return mask + torch.where(same, torch.zeros((), dtype=h.dtype), torch.full((), NEG, dtype=h.dtype))

    def _layer(
        self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, w: torch.Tensor | None
    ) -> torch.Tensor:
        layer: Any = self.layers[i]
        h = layer.attn_norm(x)
        q, k, v = qkv_rope(layer.attn, h, cos, sin)
        x = x + attend(layer.attn, q, k, v, self._mask(i, h, mask))
        h = layer.ffn_norm(x)
        if w is None:
            result: torch.Tensor = x + layer.mlp(h)
            return result
        out = w[..., 0:1] * layer.mlp(h)
        for p, ffn in enumerate(layer.pathways):
            out = out + w[..., p + 1 : p + 2] * ffn(h)
        mixed: torch.Tensor = x + out
        return mixed

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        cos, sin = _rope(inv_freq, position_ids)
        h = x
        for i in range(self.encoder_layers):
            h = self._layer(i, h, cos, sin, mask, None)
        e = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.prefix:
            e = e.cumsum(1) / (position_ids.to(e.dtype)[..., None] + 1)  # causal running mean (positions 0..T-1)
        probs = torch.softmax(self.router(e), dim=-1)
        routes = _rule(probs, self.tau)
        w = (routes[..., None] == torch.arange(self.n_paths)).to(x.dtype)  # one-hot [B, T, n + 1]
        for i in range(len(self.layers)):
            x = self._layer(i, x, cos, sin, mask, w)
        return self.lm_head(self.norm(x)), probs, routes


class RouterGraph(nn.Module):
    """Sequence-level router: the general model's first layers, mean pool, W_r, softmax, the rule.
    (input_ids [1, T], position_ids [1, T], mask [1, 1, T, T]) → (router_probs [1, n], route [1] int64)."""

    def __init__(self, general: Any, n_layers: int, weight: torch.Tensor, bias: torch.Tensor, tau: float) -> None:
        super().__init__()
        cfg = general.config
        self.embed = nn.Embedding.from_pretrained(general.model.embed_tokens.weight.detach().clone(), freeze=True)
        self.layers = nn.ModuleList([_Layer(layer, cfg) for layer in general.model.layers[:n_layers]])
        self.router = linear(weight, bias)
        self.tau = tau
        self.register_buffer("inv_freq", general.model.rotary_emb.inv_freq.detach().clone().float(), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        cos, sin = _rope(inv_freq, position_ids)
        layer: Any
        for layer in self.layers:
            h = layer.attn_norm(x)
            q, k, v = qkv_rope(layer.attn, h, cos, sin)
            x = x + attend(layer.attn, q, k, v, mask)
            x = x + layer.mlp(layer.ffn_norm(x))
        e = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).mean(1)
        probs = torch.softmax(self.router(e), dim=-1)
        return probs, _rule(probs, self.tau)


def graph_precisions(graph: GemGraph, quant: str | None) -> dict[str, str]:
    """GemGraph weight name → fp32 | int8 | int4 under a plan (``--quant`` syntax; roles: pathways are 'experts',
    the router 'router', the general FFN 'ffn'). Graph runtimes pad partial blocks, so no GGUF row fallback."""

    if quant is None:
        return {}

    def role(name: str) -> Role:
        for key, r in (
            (".pathways.", "experts"),
            ("router.", "router"),
            (".mlp.", "ffn"),
            (".attn.", "attention"),
            ("embed.", "embeddings"),
            ("lm_head.", "output"),
        ):
            if key in name or name.startswith(key):
                return r  # type: ignore[return-value]
        return "norms"

    entries = [TensorEntry(n, tuple(p.shape), n, role(n)) for n, p in graph.named_parameters()]
    try:
        plan = resolve(parse_quant(quant), entries, fit_rows=False)
        return {a.entry.hf_name: graph_precision(a.type) for a in plan.assignments}
    except ValueError as exc:
        raise MoetoolError(f"--quant {quant!r}: {exc}") from None


def trace_onnx(graph: nn.Module, path: Path, outputs: list[str]) -> None:
    """A graph taking (input_ids, position_ids, mask) to ONNX with a dynamic sequence length."""

    seq = torch.export.Dim("seq", min=2, max=4096)
    ids = torch.randint(0, 10, (1, 8))
    args = (ids, torch.arange(8)[None], causal_mask(8, 0))
    shapes = ({1: seq}, {1: seq}, {2: seq, 3: seq})
    onnx_export(graph, args, path, inputs=GRAPH_INPUTS, outputs=outputs, dynamic_shapes=shapes)
