"""SCAR: attention restricted to tokens of the same cosine k-means cluster.

The paper writes A = softmax((M ⊙ QKᵀ)/√d) with M ∈ {0, 1}. Multiplying a logit by 0 leaves exp(0) = 1 in the
softmax, so cross-cluster pairs still get weight; the correct form adds a mask: 0 inside the cluster, −inf outside
(:func:`scar_mask`). Causality: centroids are fitted once per layer on calibration text (:func:`kmeans_cosine`) and
stored with the model, and each token is assigned to its nearest centroid by itself, so no token's cluster (and no
mask entry) depends on later tokens, and prefill and decode agree. A per-sequence k-means would read the future.
"""

from __future__ import annotations

import torch


def kmeans_cosine(x: torch.Tensor, k: int, iterations: int = 10, seed: int = 0) -> torch.Tensor:
    """Centroids ``[k, D]`` of points ``x`` ``[N, D]`` under cosine distance d = 1 − cos(x, μ).

    Assignment by the smallest cosine distance; update μ_k = mean of its points (the paper's plain mean; only the
    direction matters for the next assignment). Init: k distinct points drawn with ``seed``; an empty cluster keeps
    its centroid.
    """
    if x.dim() != 2:
        raise ValueError(f"kmeans_cosine expects [N, D] points, got shape {list(x.shape)}")
    if x.shape[0] < k:
        raise ValueError(f"kmeans_cosine: {x.shape[0]} points cannot make {k} clusters")
    g = torch.Generator().manual_seed(seed)
    x = x.float()
    mu = x[torch.randperm(x.shape[0], generator=g)[:k]].clone()
    for _ in range(iterations):
        labels = assign_clusters(x, mu)
        for j in range(k):
            members = x[labels == j]
            if len(members):
                mu[j] = members.mean(0)
    return mu


def assign_clusters(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest centroid by cosine distance: ``x`` ``[..., D]``, centroids ``[k, D]`` → labels ``[...]`` (int64)."""
    xn = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    cn = centroids / centroids.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return torch.matmul(xn, cn.to(xn.dtype).transpose(0, 1)).argmax(-1)


def scar_mask(labels: torch.Tensor, neg: float = float("-inf"), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive causal same-cluster mask ``[B, 1, T, T]`` from cluster labels ``[B, T]``.

    Entry (i, j) is 0 when j ≤ i and token j is in token i's cluster, else ``neg``. The diagonal is always 0 (a token
    is in its own cluster), so no row is fully masked.
    """
    t = labels.shape[-1]
    same = labels[:, :, None] == labels[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=labels.device).tril()
    allowed = same & causal
    zero = torch.zeros((), dtype=dtype, device=labels.device)
    return torch.where(allowed, zero, torch.tensor(neg, dtype=dtype, device=labels.device))[:, None]


def multiplicative_scores(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The paper's form M ⊙ S (for comparison only): cross-cluster logits become 0, not −inf."""
    same = (labels[:, :, None] == labels[:, None, :]).to(scores.dtype)[:, None]
    return scores * same


def clustered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """SCAR computed sparsely: for each sequence and cluster, causal attention among that cluster's tokens only.

    q/k/v ``[B, H, T, hd]``, labels ``[B, T]`` → ``[B, H, T, hd]``. Costs Σ_c |C_c|² score entries per head
    instead of T²; this is the reference the masked dense form is checked against, and what bench/gem_scar.py times.
    """
    out = torch.zeros_like(q)
    scale = q.shape[-1] ** -0.5
    for b in range(q.shape[0]):
        for c in labels[b].unique():
            idx = (labels[b] == c).nonzero().squeeze(1)  # ascending positions, so tril is causal order
            qs, ks, vs = q[b][:, idx], k[b][:, idx], v[b][:, idx]
            s = torch.matmul(qs, ks.transpose(-1, -2)) * scale
            n = len(idx)
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
            out[b][:, idx] = torch.matmul(torch.softmax(s, -1), vs)
    return out


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Dense attention with an additive mask ``[B, 1, T, T]``: q/k/v ``[B, H, T, hd]`` → ``[B, H, T, hd]``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + mask
    return torch.matmul(torch.softmax(s, -1), v)


def scar_score_entries(labels: torch.Tensor) -> int:
    """Score entries SCAR computes causally per head: Σ_c |C_c|(|C_c|+1)/2 summed over the batch."""
    total = 0
    for row in labels:
        counts = torch.bincount(row)
        total += int((counts * (counts + 1) // 2).sum())
    return total
