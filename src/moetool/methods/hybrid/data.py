"""Routing data: requests of varied length from each domain, and each frozen expert's per-token log-likelihoods.

The experts are frozen, so their outputs are computed once: router training then mixes cached per-token
log-probabilities exactly as soft mixing of the experts' next-token distributions would (``log Σ_k S_k·p_k(y)``),
for thousands of epochs' worth of router steps at no expert cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetool.methods.hybrid.experts import Expert


@dataclass
class Requests:
    """``N`` requests, right-padded: ids ``[N, T]`` (BOS first), lengths ``[N]`` (tokens incl. BOS), domain ids."""

    ids: torch.Tensor
    lengths: torch.Tensor
    domains: torch.Tensor

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def mask(self) -> torch.Tensor:
        """``[N, T-1]``: 1 where target token t+1 is real."""
        t = torch.arange(self.ids.shape[1] - 1)
        return (t[None, :] < (self.lengths[:, None] - 1)).float()


def sample_requests(
    streams: list[torch.Tensor],
    *,
    per_domain: int,
    min_length: int,
    max_length: int,
    bos_id: int,
    pad_id: int,
    seed: int,
) -> Requests:
    """``per_domain`` requests from each stream, lengths log-uniform in [min_length, max_length] (short requests are
    the common case in practice), each ``<s>`` + a random window of the stream."""
    g = torch.Generator().manual_seed(seed)
    rows, lengths, domains = [], [], []
    lo, hi = math.log(min_length), math.log(max_length)
    for d, stream in enumerate(streams):
        if stream.numel() < max_length:
            raise ValueError(f"domain {d}: {stream.numel()} tokens is fewer than max_length {max_length}")
        for _ in range(per_domain):
            n = round(math.exp(lo + (hi - lo) * float(torch.rand((), generator=g))))
            n = min(max(n, min_length), max_length)
            start = int(torch.randint(0, stream.numel() - n + 2, (), generator=g))
            body = stream[start : start + n - 1]
            row = torch.full((max_length,), pad_id, dtype=torch.long)
            row[0] = bos_id
            row[1 : 1 + body.numel()] = body
            rows.append(row)
            lengths.append(1 + body.numel())
            domains.append(d)
    return Requests(torch.stack(rows), torch.tensor(lengths), torch.tensor(domains))


@dataclass
class ExpertOutputs:
    """Cached outputs: ``logp [N, K, T-1]`` (0 on padding), the encoder's hidden states ``[N, T, H]`` or None."""

    logp: torch.Tensor
    hidden: torch.Tensor | None

    def seq_nll(self, mask: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` mean NLL per token of each expert on each request."""
        return -(self.logp * mask[:, None]).sum(-1) / mask.sum(-1, keepdim=True).clamp_min(1.0)


def expert_outputs(
    experts: list[Expert], req: Requests, *, encoder: Expert | None, encoder_layers: int = 0, batch_size: int = 32
) -> ExpertOutputs:
    """Run each expert over the requests in batches (trimmed to the longest request of the batch)."""
    n, t = req.ids.shape
    logp = torch.zeros(n, len(experts), t - 1)
    hidden = None if encoder is None else torch.zeros(n, t, encoder.hidden_size)
    order = torch.argsort(req.lengths)  # similar lengths together: less padding
    for i in range(0, n, batch_size):
        idx = order[i : i + batch_size]
        width = int(req.lengths[idx].max())
        ids = req.ids[idx, :width]
        for k, e in enumerate(experts):
            logp[idx, k, : width - 1] = e.token_logp(ids)
        if encoder is not None and hidden is not None:
            hidden[idx, :width] = encoder.encode(ids, encoder_layers)
    logp = logp * req.mask[:, None]
    return ExpertOutputs(logp, hidden)


def pooled_hidden(hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[N, T, H]`` → ``[N, H]``: mean over each request's real tokens (BOS included, as at inference)."""
    m = (torch.arange(hidden.shape[1])[None, :] < lengths[:, None]).float().unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
