"""``moetool::sparse_moe``: a routed-experts block as one custom op, so a graph exporter can lower it to a runtime's
own sparse MoE kernel (onnxruntime's ``com.microsoft.MoE``: only each token's top-k experts run) instead of the
dense-masked form that computes every expert.

The op's semantics are onnxruntime's MoE with ``activation_type=swiglu, swiglu_fusion=1`` (checked against it in
tests): ``probs = softmax(logits)``; the top-k, renormalised when ``normalize``; each chosen expert computes
``fc2[e] @ (silu(g) * u)`` with ``g, u`` the even and odd rows of ``fc1[e] @ x``.

Shapes: ``x`` [N, H]; ``logits`` [N, E]; ``fc1`` [E, 2I, H] (gate and up rows interleaved: g0, u0, g1, u1, …);
``fc2`` [E, H, I]; out [N, H].
"""

from __future__ import annotations

import torch


@torch.library.custom_op("moetool::sparse_moe", mutates_args=())
def sparse_moe(
    x: torch.Tensor, logits: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, k: int, normalize: bool
) -> torch.Tensor:
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(fc1.shape[0]):
        weight = (top * (idx == e)).sum(-1).to(x.dtype)  # [N]: 0 where e is not among the token's top-k
        rows = torch.nonzero(weight).flatten()
        if rows.numel() == 0:
            continue
        h = x[rows] @ fc1[e].T  # [n, 2I]
        y = (torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]) @ fc2[e].T
        out = out.index_add(0, rows, weight[rows, None] * y)
    return out


@sparse_moe.register_fake
def _(
    x: torch.Tensor, logits: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, k: int, normalize: bool
) -> torch.Tensor:
    return torch.empty_like(x)


def fuse_experts(
    gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert ``[I, H]`` gate/up and ``[H, I]`` down weights → (fc1 [E, 2I, H] interleaved, fc2 [E, H, I])."""
    g, u = torch.stack(gate), torch.stack(up)
    e, i, h = g.shape
    return torch.stack([g, u], dim=2).reshape(e, 2 * i, h).contiguous(), torch.stack(down).contiguous()
