"""The verification gate of a GGUF with a margin: top-1 agreement counted only where rounding cannot decide it, and a
KL-divergence bound per quantization type.

Three runs over the same verification tokens (the parity windows) feed it:

- ``R``, the reference: transformers on the source model, computing in float32;
- ``D``, the dequantized-weights run: transformers on the artifact's own weights, dequantized (the conversion
  check's run; ``R`` itself for an all-f32 plan, whose weights are the source's);
- ``L``, llama.cpp on the artifact.

**Rounding check.** Every source tensor's dequantized copy must differ from it by no more than its GGUF type's
rounding can: ``||D_w - R_w|| / ||R_w|| <= ROUNDING_BOUNDS[family]`` (relative RMS error; Gaussian blocks give about
0.5% at q8_0 and 8% at q4_0); and for f16, bf16 and q8_0, whose rounding gguf-py reproduces, it must be the source
rounded: ``||D_w - round(R_w)|| / ||round(R_w)|| <= TIE_TOLERANCE``. The noise below is the rounding's only when
``D``'s weights are the source's rounded; a swapped expert or layer, a zeroed router row or a mis-mapped tensor is
60-140% off (two experts continued from one base for a few steps: 0.9% from the source rounded to q8_0), whatever it
does to the logits.
(An all-f32 plan has no dequantized copy: its weights are the source's bytes, and its conversion gate, max |Δlogit|
<= 1e-3 against the source, catches any of those.)

**Rounding noise.** At position ``t``, the plan's weight rounding moves no logit by more than
``n_t = max_v |D[t, v] - R[t, v]|``. llama.cpp also rounds what ``D`` does not contain (its activations to 8 bits
for the block types, to the weight type for the float types), so the noise the gate allows is
``noise_t = SAFETY * n_t + FLOOR``: ``SAFETY = 2`` (8-bit activation rounding is of the order of 8-bit weight
rounding, and the maximum over the vocabulary already bounds every token), ``FLOOR`` the tolerance of the plan's
coarsest float type (:data:`FLOORS`: f32 1e-3, f16 1e-2, bf16 0.1, the float plans' max |Δlogit| gates; 0 when it
has none), for llama.cpp's rounding of activations to that type.

**Margin-filtered agreement.** The reference's margin at ``t`` is ``m_t = R[t, top1] - R[t, top2]``. Moving every
logit by at most ``noise_t`` changes the margin by at most ``2 * noise_t``, so a token is *decisive*, and counted,
only when ``m_t > 2 * noise_t``; there a sound artifact's top-1 must equal the reference's. The gate requires
agreement >= :data:`MIN_AGREEMENT` over the decisive tokens, when there are at least :data:`MIN_DECISIVE` of them
(fewer: a model whose logits are nearly flat everywhere; the KL bound then decides alone, and the report says so).

**KL bound.** ``KL(R || L)`` per position, softmax in float64, its mean over the verification tokens at most
``max(KL_BOUNDS[family], KL_RATIO * min(mean KL(R || D), KL_BOUNDS[family]))``. ``KL_BOUNDS`` holds one bound per
type family (the plan's lowest-precision one), anchored on what ``llama-perplexity --kl-divergence`` reports (the
same statistic: mean KLD against the f16 model's logits) for real models. The second term serves a model more
sensitive to rounding than those (random weights move their logits further under the same rounding): a sound
file's KL is the weight rounding's, ``KL(R || D)``, plus llama.cpp's activation rounding of the same order, while a
conversion error (a wrong rope, a mis-laid tensor) shows in ``L`` and not in ``D``; it widens the bound at most
``KL_RATIO``-fold, so a broken ``D`` cannot carry the bound away with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moetool.io.jsontypes import JsonObject

# Type families, highest precision first; a plan is judged by the lowest-precision family among its matrices.
FAMILIES: tuple[tuple[str, frozenset[str]], ...] = (
    ("float", frozenset({"f32", "f16", "bf16"})),
    ("q8_0", frozenset({"q8_0"})),
    ("q6_k", frozenset({"q6_k"})),
    ("q5", frozenset({"q5_0", "q5_1", "q5_k"})),
    ("q4", frozenset({"q4_0", "q4_1", "q4_k", "iq4_nl", "iq4_xs"})),
    ("lower", frozenset({"q3_k", "q2_k", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs"})),
)

# Mean KL(reference || llama.cpp) bounds in nats. Anchors, what llama-perplexity --kl-divergence reports for sound
# files (mean KLD against the f16 model's logits):
# - float: F16 against a BF16 base rounds to 0.00000 (Mistral-Nemo 12B, llama.cpp PR #10714);
# - q8_0: 0.00139 (LLaMA 3 8B, llama.cpp's perplexity README scoreboard), 0.00024 (Watt-Tool 8B);
# - q6_k: 0.00567 (LLaMA 3 8B);
# - q5_*: q5_K_M 0.0111, q5_K_S 0.0172, q5_1 0.0185 (LLaMA 3 8B); q5_K_M 0.0047 (Watt-Tool 8B);
# - q4_*: IQ4_XS 0.0425 (LLaMA 3 8B, llama.cpp PR #12557);
# - lower: q3_K_M 0.051, IQ3_M 0.066, q3_K_S 0.164 (Watt-Tool 8B), UD-Q2_K_XL 0.178, UD-IQ1_S 0.56 (Unsloth's
#   Kimi quants).
# Small models lose more than 8B ones: the real SmolLM2-135M MoE at q8_0 measures 0.0069 here (its weight rounding
# alone 0.0015, llama.cpp's 8-bit activations the rest). The bounds sit at about 4x that scale (20x the 8B anchor at
# q8_0, 6x at q4), so a sound artifact passes with room; a broken one (a wrong rope base: 0.3-0.4 on the tests' tiny
# MoE; swapped layers: 1.3) fails. bf16 weights keep 3 mantissa bits fewer than f16, hence 1e-3 for the float family.
KL_BOUNDS: dict[str, float] = {
    "float": 1e-3,
    "q8_0": 0.03,
    "q6_k": 0.06,
    "q5": 0.12,
    "q4": 0.25,
    "lower": 0.8,
}
KL_RATIO = 4.0
# Relative RMS error ||dequantized - source|| / ||source|| one tensor may have, by its type's family: about 5x what
# rounding Gaussian blocks gives (f16 0.03%, bf16 0.2%, q8_0 0.5%, q6_k 1.2%, q5_0 2.5%, q4_0 8%, q3_k 15%, q2_k 30%),
# below the 58-141% of a zeroed router row (3 experts) or a tensor swapped for an unrelated one.
ROUNDING_BOUNDS: dict[str, float] = {
    "float": 0.01,
    "q8_0": 0.03,
    "q6_k": 0.06,
    "q5": 0.12,
    "q4": 0.3,
    "lower": 0.7,
}
# A tensor of a type gguf-py rounds as llama.cpp does (f16, bf16, q8_0) must be the source rounded here, but for the
# few ties llama.cpp's quantizer (which writes every type of a plan with K types) rounds the other way: a tensor
# swapped for a near-copy (two experts continued from one base for a few steps differ by ~0.5%) is further off.
TIE_TOLERANCE = 2e-3
# llama.cpp's arithmetic on float weights, which the dequantized run does not reproduce (exporter.GATES)
FLOORS: dict[str, float] = {"f32": 1e-3, "f16": 1e-2, "bf16": 1e-1}
SAFETY = 2.0
MIN_AGREEMENT = 0.98
MIN_DECISIVE = 16  # below it, one token moves agreement by more than 6%: too few to judge


def family_of(types: set[str]) -> str:
    """The lowest-precision family among ``types`` (the plan's matrix types); an unknown type counts as ``lower``."""
    rank = {t: i for i, (_, members) in enumerate(FAMILIES) for t in members}
    worst = max((rank.get(t, len(FAMILIES) - 1) for t in types), default=0)
    return FAMILIES[worst][0]


def floor_of(types: set[str]) -> float:
    """The runtime's own float rounding allowed on top of the measured noise: the widest float type's tolerance."""
    return max((FLOORS[t] for t in types if t in FLOORS), default=0.0)


@dataclass(frozen=True)
class GateReport:
    """The margin gate's figures and verdict (``manifest.json``'s ``parity.gate``).

    Attributes:
        family: the plan's lowest-precision type family, which picks the KL bound.
        tokens: verification tokens (positions of the parity windows).
        decisive: tokens whose reference margin exceeds twice the rounding noise (the ones agreement counts).
        agreement: llama.cpp's top-1 against the reference's over the decisive tokens (None when there are none).
        min_agreement: what ``agreement`` must reach when ``decisive >= min_decisive``.
        min_decisive: the fewest decisive tokens agreement is judged on.
        noise_median / noise_p99 / noise_max: the rounding noise ``noise_t`` over the tokens.
        safety: the factor on the dequantized run's per-position max |Δlogit|.
        floor: the runtime's float rounding added to it.
        kl_mean / kl_max: KL(reference || llama.cpp) over the tokens, nats.
        kl_rounding: mean KL(reference || dequantized-weights run): what the weight rounding alone costs.
        kl_family_bound: the family's bound (:data:`KL_BOUNDS`).
        kl_bound: the bound ``kl_mean`` is held to:
            ``max(kl_family_bound, KL_RATIO * min(kl_rounding, kl_family_bound))``.
        rounding: the largest relative error of a dequantized tensor against its source, by GGUF type (empty when
            the artifact's weights are the source's, an f32 plan).
        raw_top1: llama.cpp's top-1 against the reference's over every token (no margin).
        raw_top1_conversion: the old gate's figure: llama.cpp's top-1 against the dequantized run's, every token
            (it required >= 0.95 of a quantized plan).
        problems: why the gate failed (empty when it passed).
    """

    family: str
    tokens: int
    decisive: int
    agreement: float | None
    min_agreement: float
    min_decisive: int
    noise_median: float
    noise_p99: float
    noise_max: float
    safety: float
    floor: float
    kl_mean: float
    kl_max: float
    kl_rounding: float
    kl_family_bound: float
    kl_bound: float
    rounding: dict[str, float]
    raw_top1: float
    raw_top1_conversion: float
    problems: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def agreement_judged(self) -> bool:
        """Whether enough tokens were decisive for the agreement to count (else the KL bound decides alone)."""
        return self.decisive >= self.min_decisive

    def to_json(self) -> JsonObject:
        doc = asdict(self)
        doc["problems"] = list(self.problems)
        doc["verdict"] = "pass" if self.passed else "fail"
        for key, value in doc.items():
            if isinstance(value, float):
                doc[key] = float(f"{value:.6g}")
        doc["rounding"] = {t: float(f"{e:.4g}") for t, e in self.rounding.items()}
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> GateReport:
        """The report a manifest recorded (derived keys, such as ``verdict``, are ignored).

        Raises:
            TypeError: a field is missing (not a gate report).
        """
        names = set(cls.__dataclass_fields__)
        fields = {k: v for k, v in doc.items() if k in names}
        fields["problems"] = tuple(doc.get("problems", ()))
        return cls(**fields)


def kl_divergence(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(got)) per row of ``[T, V]`` logits, in float64 (nats)."""
    log_p = _log_softmax(ref)
    log_q = _log_softmax(got)
    kl: np.ndarray = np.maximum((np.exp(log_p) * (log_p - log_q)).sum(-1), 0.0)  # rounding leaves -1e-17
    return kl


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    out: np.ndarray = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return out


def top_margin(logits: np.ndarray) -> np.ndarray:
    """Per row of ``[T, V]``: the top-1 logit minus the top-2."""
    top2: np.ndarray = np.partition(logits, -2, axis=-1)[:, -2:]
    margin: np.ndarray = top2[:, 1] - top2[:, 0]
    return margin


def rounding_problems(rounding: dict[str, tuple[str, float, float | None]]) -> tuple[dict[str, float], list[str]]:
    """The worst relative error per GGUF type, and the problems: tensors past their family's bound, and tensors of a
    reproducible type (f16, bf16, q8_0) that are not the source rounded (beyond :data:`TIE_TOLERANCE`)."""
    worst: dict[str, float] = {}
    over = []
    moved = []
    for name, (kind, err, off) in rounding.items():
        worst[kind] = max(worst.get(kind, 0.0), err)
        bound = ROUNDING_BOUNDS[family_of({kind})]
        if not err <= bound:  # NaN fails too
            over.append((err, name, kind, bound))
        elif off is not None and not off <= TIE_TOLERANCE:
            moved.append((off, name, kind))
    problems = []
    if moved:
        off, name, kind = max(moved)
        problems.append(
            f"{len(moved)} tensor(s) of the artifact are not the source's weights rounded: {name} ({kind}) lies "
            f"{100 * off:.2f}% from the source rounded to {kind} (rounding ties allow {100 * TIE_TOLERANCE:.1f}%)"
        )
    if over:
        err, name, kind, bound = max(over)
        problems.append(
            f"{len(over)} tensor(s) of the artifact are not the source's weights rounded: {name} ({kind}) differs "
            f"from its source by {100 * err:.0f}% (rounding to {kind} moves at most {100 * bound:.0f}%)"
        )
    return worst, problems


def margin_gate(
    ref: list[np.ndarray],
    own: list[np.ndarray] | None,
    got: list[np.ndarray],
    types: set[str],
    rounding: dict[str, tuple[str, float, float | None]] | None = None,
) -> GateReport:
    """The gate over the verification windows: ``ref`` (R), ``own`` (D; None when the artifact's weights are the
    source's) and ``got`` (L), each one ``[T, V]`` array per window in the same order; ``types`` the plan's matrix
    types; ``rounding`` each source tensor's (GGUF type, relative error, distance from the source rounded here) of its
    dequantized copy (:class:`moetool.export.gguf.dequant.ArtifactWeights`). See the module
    docstring for the rule."""
    own = own if own is not None else ref
    floor = floor_of(types)
    family = family_of(types)
    noise, margin, same, conv, kl, kl_own = [], [], [], [], [], []
    for r, d, g in zip(ref, own, got, strict=True):
        noise.append(SAFETY * np.abs(d.astype(np.float64) - r).max(-1) + floor)
        margin.append(top_margin(r.astype(np.float64)))
        same.append(r.argmax(-1) == g.argmax(-1))
        conv.append(d.argmax(-1) == g.argmax(-1))
        kl.append(kl_divergence(r, g))
        kl_own.append(kl_divergence(r, d))
    n, m, s, c, k, ko = (np.concatenate(x) for x in (noise, margin, same, conv, kl, kl_own))
    decisive = m > 2 * n
    count = int(decisive.sum())
    agree = float(s[decisive].mean()) if count else None
    worst, problems = rounding_problems(rounding or {})
    if count >= MIN_DECISIVE and agree is not None and agree < MIN_AGREEMENT:
        problems.append(
            f"top-1 agreement {agree:.3f} < {MIN_AGREEMENT} on the {count} of {len(m)} tokens whose reference "
            f"margin exceeds twice the rounding noise"
        )
    kl_mean, kl_rounding = float(k.mean()), float(ko.mean())
    # the rounding's own KL widens the bound at most KL_RATIO-fold: a broken D (swapped layers) cannot carry it away
    bound = max(KL_BOUNDS[family], KL_RATIO * min(kl_rounding, KL_BOUNDS[family]))
    if not kl_mean <= bound:  # NaN fails too
        problems.append(f"mean KL(reference || llama.cpp) {kl_mean:.3g} > {bound:.3g} for a {family} plan")
    return GateReport(
        family=family,
        tokens=len(m),
        decisive=count,
        agreement=agree,
        min_agreement=MIN_AGREEMENT,
        min_decisive=MIN_DECISIVE,
        noise_median=float(np.median(n)),
        noise_p99=float(np.quantile(n, 0.99)),
        noise_max=float(n.max()),
        safety=SAFETY,
        floor=floor,
        kl_mean=kl_mean,
        kl_max=float(k.max()),
        kl_rounding=kl_rounding,
        kl_family_bound=KL_BOUNDS[family],
        kl_bound=bound,
        rounding=worst,
        raw_top1=float(s.mean()),
        raw_top1_conversion=float(c.mean()),
        problems=tuple(problems),
    )
