"""An export-friendly causal LM owned by moetool: static shapes, explicit mask/positions/KV cache.

Built from a loaded transformers model (Mixtral, Qwen2-MoE, Qwen3-MoE and the dense llama/mistral/qwen2/qwen3
families), sharing its weights, but with a forward every graph converter can trace:

- MoE blocks in a *dense-masked* form: every expert is an ``nn.Linear`` triple and runs on every token; the
  router's top-k weights are scattered into an [T, E] matrix (zero for unchosen experts) that weights the sum. No
  data-dependent shapes (the converters choke on transformers' ``nonzero``/grouped paths), and every expert weight is
  a 2-D MatMul a weight quantizer can reach. It computes E/k times the FFN work of a sparse kernel.
- attention written out (no SDPA), GQA by repeat, rope from explicit ``position_ids`` (scaled rope as transformers
  computes it, see ``graph/rope.py``), an additive mask given by the caller, and the KV cache as explicit inputs and
  outputs: ``past[i] = (k, v)`` of shape [B, kv_heads, P, hd].

Shapes: ``input_ids`` [B, T] int64; ``position_ids`` [B, T] int64; ``mask`` [B, 1, T, P+T] float (0 or -inf-ish);
``past_k_i``/``past_v_i`` [B, kv_heads, P, head_dim]; logits [B, T, V].
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    from transformers import PretrainedConfig

import torch
from torch import nn

from moetool.arch.facts import ModelFacts
from moetool.arch.outputs import NULL_SHARED_KEY
from moetool.arch.records import graph_model_types, model_record
from moetool.export.graph.rope import GraphRope
from moetool.export.graph.sparse import fuse_experts, sparse_moe

NEG = -1e9  # additive mask value: finite, so a fully masked row stays finite in every runtime
# one layer's cached keys and values, each [B, kv_heads, P, head_dim]
KVPair: TypeAlias = tuple[torch.Tensor, torch.Tensor]


class HFNorm(Protocol):
    """A transformers norm (or router) as read here: its weight."""

    weight: torch.Tensor


class HFLinear(HFNorm, Protocol):
    """A transformers projection: its weight and its bias (None without one)."""

    bias: torch.Tensor | None


class HFAttention(Protocol):
    """A transformers attention module's projections (``q_norm``/``k_norm`` are read where present)."""

    q_proj: HFLinear
    k_proj: HFLinear
    v_proj: HFLinear
    o_proj: HFLinear


class HFDecoderLayer(Protocol):
    """A transformers decoder layer: its two norms and its attention (the MLP is read by the caller)."""

    input_layernorm: HFNorm
    post_attention_layernorm: HFNorm
    self_attn: HFAttention


class HFExperts(Protocol):
    """transformers 5's fused experts: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor


class HFMoE(Protocol):
    """A transformers MoE block: its router and fused experts (a shared expert and its gate are read where present)."""

    gate: HFNorm
    experts: HFExperts


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(shared(weight), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def shared(w: torch.Tensor) -> torch.Tensor:
    """``w`` detached, in the source model's own memory where it is contiguous: the export model and the transformers
    model it checks against hold one copy of the weights, not two (nothing writes into either)."""
    return w.detach().contiguous()


def linear(w: torch.Tensor, b: torch.Tensor | None = None) -> nn.Linear:
    """A frozen ``nn.Linear`` over ``w`` ``[out, in]`` (and ``b`` ``[out]``), sharing their memory: what every traced
    graph is built of, so exporters see plain Linear ops whatever module the weights came from."""
    with torch.device("meta"):  # no throwaway initialisation of a full-size weight
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    lin.weight = nn.Parameter(shared(w), requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(shared(b), requires_grad=False)
    return lin


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): one expert, a shared expert or a dense MLP."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(gate), linear(up), linear(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class DenseMaskedMoE(nn.Module):
    """Top-k softmax routing over per-expert MLPs, every expert evaluated, unchosen ones weighted 0."""

    def __init__(
        self,
        router: torch.Tensor,
        experts: list[GatedMLP],
        top_k: int,
        norm_topk: bool,
        shared: GatedMLP | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.router = linear(router)
        self.experts = nn.ModuleList(experts)
        self.top_k, self.norm_topk = top_k, norm_topk
        self.shared = shared
        self.shared_gate = None if shared_gate is None else linear(shared_gate)
        self.sparse = False

    def make_sparse(self) -> None:
        """Route through ``moetool::sparse_moe`` (lowered to a runtime's sparse MoE kernel) from now on; the fused
        expert weights it reads are buffers, so the per-expert Linears drop out of a traced graph."""
        experts = [e for e in self.experts if isinstance(e, GatedMLP)]
        fc1, fc2 = fuse_experts(
            [e.gate_proj.weight for e in experts],
            [e.up_proj.weight for e in experts],
            [e.down_proj.weight for e in experts],
        )
        self.register_buffer("fc1", fc1, persistent=False)
        self.register_buffer("fc2", fc2, persistent=False)
        self.sparse = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sparse:
            flat = x.reshape(-1, x.shape[-1])
            fc1: torch.Tensor = self.fc1  # type: ignore[assignment]
            fc2: torch.Tensor = self.fc2  # type: ignore[assignment]
            routed: torch.Tensor = sparse_moe(flat, self.router(flat), fc1, fc2, self.top_k, self.norm_topk)
            out = routed.reshape(x.shape)
            return out + self._shared(x) if self.shared is not None else out
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [B, T, E]
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(-1, idx, top).to(x.dtype)  # [B, T, E]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + weights[..., e : e + 1] * expert(x)
        if self.shared is not None:
            out = out + self._shared(x)
        result: torch.Tensor = out
        return result

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shared is not None
        s: torch.Tensor = self.shared(x)
        if self.shared_gate is not None:
            s = torch.sigmoid(self.shared_gate(x)) * s
        return s


def rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    """Rope's rotate-half with a Python-int split (a traced ``shape // 2`` is an op Core ML cannot fold)."""
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qkv_rope(
    a: Attention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bt: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projections of ``h`` [B, T, D] by Attention ``a``, with q/k norms and rope: q [B, H, T, hd], k/v [B, kv, T, hd].

    ``bt`` gives B and T when the caller knows them better than ``h.shape`` (Core ML's tracer needs batch 1 as a
    constant, not a traced size).
    """
    b, t = bt if bt is not None else h.shape[:2]
    q = a.q(h).view(b, t, a.n_head, a.head_dim)
    k = a.k(h).view(b, t, a.n_kv, a.head_dim)
    v = a.v(h).view(b, t, a.n_kv, a.head_dim).transpose(1, 2)
    if a.q_norm is not None and a.k_norm is not None:
        q, k = a.q_norm(q), a.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    half = a.head_dim // 2
    return q * cos + rotate_half(q, half) * sin, k * cos + rotate_half(k, half) * sin, v


def attend(
    a: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    bt: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Masked attention of q [B, H, T, hd] over k/v [B, kv, S, hd] → the output projection's result [B, T, D].

    GQA without repeating K/V: the query heads of one KV head are stacked along the query axis, so no reshape touches
    the (dynamic) cache length.
    """
    b, t = bt if bt is not None else (q.shape[0], q.shape[2])
    rep = a.n_head // a.n_kv
    qg = q.contiguous().view(b, a.n_kv, rep * t, a.head_dim)
    mask_g = mask.repeat(1, 1, rep, 1) if rep > 1 else mask  # [B, 1, rep·T, S]
    scores = torch.matmul(qg, k.transpose(2, 3)) * (a.head_dim**-0.5) + mask_g
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    y = torch.matmul(probs, v).contiguous().view(b, a.n_head, t, a.head_dim)
    out: torch.Tensor = a.o(y.transpose(1, 2).reshape(b, t, a.n_head * a.head_dim))
    return out


class Attention(nn.Module):
    def __init__(self, attn: HFAttention, cfg: PretrainedConfig, eps: float) -> None:
        super().__init__()
        self.n_head = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_head)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_head)
        get_b = lambda m: None if m.bias is None else m.bias  # noqa: E731
        self.q = linear(attn.q_proj.weight, get_b(attn.q_proj))
        self.k = linear(attn.k_proj.weight, get_b(attn.k_proj))
        self.v = linear(attn.v_proj.weight, get_b(attn.v_proj))
        self.o = linear(attn.o_proj.weight, get_b(attn.o_proj))
        qn = getattr(attn, "q_norm", None)
        self.q_norm = None if qn is None else RMSNorm(qn.weight, eps)
        kn = getattr(attn, "k_norm", None)
        self.k_norm = None if kn is None else RMSNorm(kn.weight, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, past: KVPair | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(attention output, keys, values): ``past``'s cached keys and values with the new positions'."""
        q, k, v = qkv_rope(self, x, cos, sin)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        return attend(self, q, k, v, mask), k, v


class Block(nn.Module):
    def __init__(self, layer: HFDecoderLayer, cfg: PretrainedConfig, eps: float, mlp: nn.Module) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(layer.input_layernorm.weight, eps)
        self.attn = Attention(layer.self_attn, cfg, eps)
        self.ffn_norm = RMSNorm(layer.post_attention_layernorm.weight, eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        past = None if past_k is None or past_v is None else (past_k, past_v)
        a, k, v = self.attn(self.attn_norm(x), cos, sin, mask, past)
        x = x + a
        return x + self.mlp(self.ffn_norm(x)), k, v


def _moe(mlp: HFMoE, cfg: PretrainedConfig, rec: ModelFacts) -> nn.Module:
    """Per-expert MLPs from transformers 5's fused expert tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    ex = mlp.experts
    inter = ex.down_proj.shape[-1]
    experts = [
        GatedMLP(ex.gate_up_proj[e, :inter], ex.gate_up_proj[e, inter:], ex.down_proj[e])
        for e in range(ex.gate_up_proj.shape[0])
    ]
    shared = getattr(mlp, "shared_expert", None)
    shared_mlp = None
    # moetool's null shared expert (arch.outputs) adds exactly nothing: the graph leaves it out
    if shared is not None and shared.gate_proj.weight.shape[0] > 0 and not getattr(cfg, NULL_SHARED_KEY, False):
        shared_mlp = GatedMLP(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    gate = getattr(mlp, "shared_expert_gate", None)
    norm = rec.normalises_topk(cfg)
    return DenseMaskedMoE(
        mlp.gate.weight,
        experts,
        int(cfg.num_experts_per_tok),
        norm,
        shared_mlp,
        None if shared_mlp is None or gate is None else gate.weight,
    )


class ExportLM(nn.Module):
    """The whole model: ``forward(input_ids, position_ids, mask, *past) -> (logits, *present)``.

    ``past`` is ``k_0, v_0, k_1, v_1, …`` (or empty for the prefill graph); ``present`` the same with the new
    positions appended.
    """

    def __init__(self, hf: Any) -> None:
        super().__init__()
        cfg = hf.config
        rec = model_record(cfg.model_type)
        if rec is None or not rec.graph_targets:
            raise ValueError(f"model_type {cfg.model_type!r}: graph export supports {', '.join(graph_model_types())}")
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        inner = hf.model
        self.embed = nn.Embedding.from_pretrained(shared(inner.embed_tokens.weight), freeze=True)
        self._facts = (cfg, rec, eps)  # what block_of needs (a tuple: no submodule, no parameter)
        blocks = [self.block_of(layer) for layer in inner.layers]
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(inner.norm.weight, eps)
        self.lm_head = linear(hf.lm_head.weight)
        self.rope = GraphRope(cfg, inner.rotary_emb)  # refuses a rope type a traced graph cannot compute
        self.n_layers = len(blocks)
        self.n_kv = blocks[0].attn.n_kv
        self.head_dim = blocks[0].attn.head_dim

    def block_of(self, layer: Any) -> Block:
        """The export block of one transformers decoder layer of this model, sharing its weights: what a streamed
        export builds for each layer as it is read (:mod:`moetool.export.onnx.weights`)."""
        cfg, rec, eps = self._facts
        m = layer.mlp
        mlp = (
            _moe(m, cfg, rec)
            if hasattr(m, "experts")
            else GatedMLP(m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
        )
        return Block(layer, cfg, eps, mlp)

    def blocks(self) -> list[Block]:
        """The decoder blocks (``layers`` is their ``nn.ModuleList``)."""
        return [b for b in self.layers if isinstance(b, Block)]

    def make_sparse(self) -> int:
        """Every MoE block through ``moetool::sparse_moe`` (see :meth:`DenseMaskedMoE.make_sparse`); returns how many."""
        for block in self.layers:
            mlp = block.mlp
            if isinstance(mlp, DenseMaskedMoE) and not mlp.sparse:
                mlp.make_sparse()
        return self.sparse_moe_layers()

    def sparse_moe_layers(self) -> int:
        return sum(isinstance(b.mlp, DenseMaskedMoE) and bool(b.mlp.sparse) for b in self.layers)

    def moe_layers(self) -> int:
        """How many blocks route over experts (dense-masked or sparse)."""
        return sum(isinstance(b.mlp, DenseMaskedMoE) for b in self.layers)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        x = self.embed(input_ids)
        cos, sin = self.rope(position_ids, x.dtype)  # [B, 1, T, hd]
        present: list[torch.Tensor] = []
        for i, block in enumerate(self.layers):
            pk = past[2 * i] if past else None
            pv = past[2 * i + 1] if past else None
            x, k, v = block(x, cos, sin, mask, pk, pv)
            present += [k, v]
        return (self.lm_head(self.norm(x)), *present)


def causal_mask(t: int, past: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, 1, T, P+T] additive mask: position i of the new tokens sees the past and new tokens ≤ i."""
    full = torch.full((t, past + t), NEG, dtype=dtype)
    full = torch.triu(full, diagonal=past + 1)
    return full[None, None].expand(batch, 1, t, past + t).contiguous()


def prefill_inputs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t = ids.shape
    pos = torch.arange(t)[None].expand(b, t).contiguous()
    return ids, pos, causal_mask(t, 0, b)


def load_export_model(model_dir: Path | str) -> tuple[nn.Module, ExportLM]:
    """(transformers model in fp32, its ExportLM)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return hf, ExportLM(hf).eval()
