"""GEM's robustness metrics (arXiv 2503.22698, Sec. 1.3) over any "higher is better" performance.

moetool evaluates language models by perplexity, so it uses ``Perf = 1 / perplexity`` = exp(−mean token NLL), the
geometric-mean probability a model gives each held-out token: in (0, 1] and higher-is-better, like the paper's F1.
"""

from __future__ import annotations

from collections.abc import Mapping

from moetool.errors import MoetoolError


def _check(x: float, what: str) -> float:
    if x == 0:
        raise MoetoolError(f"{what} is zero; the ratio is undefined")
    return x


def generalization_gap(in_domain: float, out_of_domain: float) -> float:
    """GG = (Perf_in − Perf_out) / Perf_in. Negative when the model does better off its domain."""
    return (in_domain - out_of_domain) / _check(in_domain, "in-domain performance")


def cross_domain_transfer_ratio(source: float, target: float) -> float:
    """CDTR(M, D_i → D_j) = Perf(M, D_j) / Perf(M, D_i)."""
    return target / _check(source, "source-domain performance")


def domain_specialization_index(own: float, others: list[float]) -> float:
    """DSI(M, D) = Perf(M, D) / mean over the other domains D' of Perf(M, D')."""
    if not others:
        raise MoetoolError("DSI needs at least one other domain")
    return own / _check(sum(others) / len(others), "mean performance on the other domains")


def gem_metrics(perf: Mapping[str, float], own_domain: str | None) -> dict[str, object]:
    """GG, DSI per domain and the CDTR matrix of one model, from its per-domain performance.

    For a model with an own domain (an expert), ``gg`` and ``dsi`` are for that domain. For a general model (the
    base, an MoE), ``gg`` and ``dsi`` average the per-domain values, treating each domain in turn as "own".
    """
    domains = list(perf)
    per_gg, per_dsi = {}, {}
    for d in domains:
        others = [perf[o] for o in domains if o != d]
        if not others:
            continue
        per_gg[d] = generalization_gap(perf[d], sum(others) / len(others))
        per_dsi[d] = domain_specialization_index(perf[d], others)
    cdtr = {a: {b: cross_domain_transfer_ratio(perf[a], perf[b]) for b in domains} for a in domains}
    if own_domain is not None and own_domain in per_gg:
        gg, dsi = per_gg[own_domain], per_dsi[own_domain]
    else:
        gg = sum(per_gg.values()) / max(1, len(per_gg))
        dsi = sum(per_dsi.values()) / max(1, len(per_dsi))
    return {
        "own_domain": own_domain,
        "gg": gg,
        "dsi": dsi,
        "gg_per_domain": per_gg,
        "dsi_per_domain": per_dsi,
        "cdtr": cdtr,
    }
