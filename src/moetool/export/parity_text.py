"""A parity record in words, for the CLI and the model card alike: the verdict, then the figures it holds.

Plain text (no markup): the CLI colours the verdict, the card puts the phrases in a table cell.
"""

from __future__ import annotations

from moetool.export.gate import GateReport
from moetool.export.parity import ParityRecord, Refused


def verdict_text(r: ParityRecord | str | None) -> str:
    """``pass (max abs Δlogit ≤ 0.0001)``, ``pass (margin gate, q8_0 plan)``, ``reported (no tolerance)``, or the reason
    it was not verified."""
    if not isinstance(r, ParityRecord):
        return r or "not verified"
    held = []
    if r.tolerance is not None:
        held.append(f"max abs Δlogit ≤ {r.tolerance:g}")
    if r.gate is not None:
        held.append(f"margin gate, {r.gate.family} plan")
    if r.bundle is not None:
        held.append("router and members each checked")
    return f"{r.outcome} ({'; '.join(held) or 'figures only, no tolerance'})"


def figures(r: ParityRecord, *, gate: bool = True) -> list[str]:
    """The figures ``r`` holds, one phrase each (``max abs Δlogit 1.2e-05 @32, 3.4e-05 @128 tokens``, …: no ``|``,
    so a phrase fits a Markdown table cell); with ``gate``, the margin gate's headline figures too
    (:func:`gate_text` has them all)."""
    parts: list[str] = []
    d = r.max_abs_logit_diff
    if isinstance(d, dict) and d:
        parts.append(f"max abs Δlogit {', '.join(f'{v:.1e} @{k}' for k, v in d.items())} tokens")
    elif isinstance(d, float):
        parts.append(f"max abs Δlogit {d:.1e}")
    if r.routes is not None:
        parts += _route_phrases(r)
    if r.top1_agreement is not None:
        parts.append(f"top-1 agreement {100 * r.top1_agreement:.2f}%")
    if r.ppl_change is not None:
        parts.append(f"perplexity {100 * r.ppl_change:+.2f}%")
    elif r.ppl_reference is not None and r.ppl_artifact is not None:
        parts.append(f"perplexity {r.ppl_reference:.3f} → {r.ppl_artifact:.3f}")
    if r.decode is not None:
        parts.append(f"cached decode {r.decode.max_abs_logit_diff:.1e}")
    if r.conversion is not None:
        conv = max(r.conversion.max_abs_logit_diff.values(), default=0.0)
        parts.append(
            f"conversion alone (artifact's own weights) {conv:.1e}, top-1 {100 * r.conversion.top1_agreement:.2f}%"
        )
    if r.weights is not None:
        parts.append(f"{r.weights.identical} of {r.weights.modules} quantized modules their source rounded")
    if r.tokenizer is not None:
        probes = f" on {r.tokenizer.probes} probes" if r.tokenizer.probes is not None else ""
        parts.append(("tokenizer matches" if r.tokenizer.match else "tokenizer DIFFERS") + probes)
    if gate and r.gate is not None:
        parts.append(_gate_phrase(r.gate))
    parts += [f"{k} {_compact(v)}" for k, v in r.extra.items() if isinstance(v, int | float | str | bool)]
    return parts


def _gate_phrase(g: GateReport) -> str:
    agree = (
        f"top-1 {100 * g.agreement:.2f}% on {g.decisive} decisive tokens"
        if g.agreement is not None and g.agreement_judged
        else f"top-1 not judged ({g.decisive} decisive tokens)"
    )
    return f"margin gate {'pass' if g.passed else 'FAIL'}: {agree}, mean KL {g.kl_mean:.2g} ≤ {g.kl_bound:.2g}"


def _route_phrases(r: ParityRecord) -> list[str]:
    routes = r.routes
    assert routes is not None
    off = routes.mismatches_off_boundary
    boundary = f" ({off} off the tau boundary)" if off is not None else ""
    windows = r.windows if r.windows is not None else "?"
    phrases = (  # each only where the check measured it
        None if routes.max_abs_prob_diff is None else f"max abs ΔP {routes.max_abs_prob_diff:.1e}",
        None if routes.max_abs_score_diff is None else f"max abs Δscore {routes.max_abs_score_diff:.1e}",
        None if routes.mismatches is None else f"{routes.mismatches} route(s) differ{boundary}",
        None if routes.same_route is None else f"same route on {routes.same_route} of {windows} windows",
        None if routes.choice_agreement is None else f"choice agreement {100 * routes.choice_agreement:.2f}%",
    )
    return [p for p in phrases if p is not None]


def _compact(v: int | float | str | bool) -> str:
    return f"{v:.2g}" if isinstance(v, float) else str(v)


def describe(r: ParityRecord | str | None) -> str:
    """The record on one line: the verdict, the figures, and for a bundle its router's and each member's."""
    if not isinstance(r, ParityRecord):
        return verdict_text(r)
    if r.bundle is not None:
        parts = [f"router: {describe(r.bundle.router)}"]
        for name, m in r.bundle.members.items():
            parts.append(f"{name}: not exported ({m.reason})" if isinstance(m, Refused) else f"{name}: {describe(m)}")
        return "; ".join(parts)
    text = f"{verdict_text(r)}: {'; '.join(figures(r)) or 'no figures'}"
    if r.runtime_not_run is not None:  # the figures are the converted torch wrapper's, not Core ML's (macOS only)
        text = (
            f"torch wrapper that was converted (Core ML runs on macOS only; see scripts/coreml_parity_mac.py): {text}"
        )
    return text


def gate_text(g: GateReport) -> str:
    """The margin gate's verdict and figures on one line, beside the old gate's raw top-1."""
    if g.agreement is None or not g.agreement_judged:
        agree = f"top-1 not judged ({g.decisive} of {g.tokens} tokens decisive, {g.min_decisive} needed)"
    else:
        agree = f"top-1 {g.agreement:.4f} on {g.decisive} of {g.tokens} decisive tokens (≥ {g.min_agreement})"
    worst = max(g.rounding.values(), default=0.0)
    return (
        f"gate ({g.family} plan): {'pass' if g.passed else 'FAIL'}: {agree}, margin > 2 × noise (median "
        f"{g.noise_median:.3g}, max {g.noise_max:.3g}); mean KL {g.kl_mean:.3g} (max {g.kl_max:.3g}) ≤ "
        f"{g.kl_bound:.3g}; weights within rounding (worst {100 * worst:.2f}%); raw top-1 {g.raw_top1:.4f}, old gate "
        f"(conversion top-1 ≥ 0.95) {g.raw_top1_conversion:.4f}"
    )
