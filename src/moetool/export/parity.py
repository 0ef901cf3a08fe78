"""One typed parity record for every exporter: what was compared, at which lengths, how far the artifact's logits
are from the reference's, top-1 agreement, the perplexity change, the tolerance and the verdict.

A manifest's ``parity`` is either a :class:`ParityRecord` written by :meth:`ParityRecord.to_json` or a string saying
why there are no figures (:data:`NOT_VERIFIED`). :meth:`ParityRecord.to_json` writes the layout manifests have always
had (``runtime``, ``reference``, ``seq_lens``, ``max_abs_logit_diff`` per length, ``top1_agreement``, ``ppl_*``,
GGUF's ``tokenizer_*``/``conversion``/``gate``, the graph targets' ``decode``/``export_model_vs_transformers``,
GEM's route figures, a bundle's ``router``/``members``), plus ``tolerance`` and ``verdict`` where the exporter
recorded them; :func:`parity_of` reads any manifest's parity back, old or new.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from moetool.export.gate import GateReport
from moetool.export.parity_parts import (
    ROUTE_KEYS,
    ConversionCheck,
    DecodeCheck,
    Measured,
    RoundingCheck,
    RouteCheck,
    TokenizerCheck,
    TokenizerMismatch,
    as_float,
    as_floats,
    as_int,
    as_ints,
    as_str,
    put,
)
from moetool.io.jsontypes import JsonObject, JsonValue

__all__ = [
    "NOT_VERIFIED",
    "BundleParity",
    "ConversionCheck",
    "DecodeCheck",
    "Measured",
    "ParityRecord",
    "Refused",
    "RoundingCheck",
    "RouteCheck",
    "TokenizerCheck",
    "TokenizerMismatch",
    "Verdict",
    "parity_of",
]  # the parts are re-exported: one import for exporters and methods

NOT_VERIFIED = "not verified (--no-verify)"  # a manifest's parity when the check was skipped

Verdict = Literal["pass", "fail", "reported"]
VERDICTS: tuple[Verdict, ...] = ("pass", "fail", "reported")
"""``pass``/``fail``: held to a tolerance or a gate; ``reported``: figures only (a quantized graph, a method's own)."""


@dataclass(frozen=True)
class Refused:
    """A bundle member the target could not take, and why."""

    reason: str


@dataclass(frozen=True)
class BundleParity:
    """A bundle's parts: its router graph's check (None where it recorded none) and each member's parity record,
    the reason it was not verified, or why the target refused it."""

    router: ParityRecord | str | None
    members: dict[str, ParityRecord | Refused | str | None]

    def to_json(self) -> JsonObject:
        """``router`` and ``members``, as a bundle's ``parity`` holds them."""
        return {
            "router": self.router.to_json() if isinstance(self.router, ParityRecord) else self.router,
            "members": {name: _member_json(m) for name, m in self.members.items()},
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, JsonValue]) -> BundleParity | None:
        """The parts of a bundle's parity object (None where ``doc`` has no ``router`` and ``members``)."""
        members = doc.get("members")
        if "router" not in doc or not isinstance(members, dict):
            return None
        return cls(
            router=parity_of(doc["router"]),
            members={name: _member(m) for name, m in members.items()},
        )


def _member_json(m: ParityRecord | Refused | str | None) -> JsonValue:
    if isinstance(m, ParityRecord):
        return m.to_json()
    if isinstance(m, Refused):
        return {"exported": False, "reason": m.reason}
    return m


def _member(v: JsonValue) -> ParityRecord | Refused | str | None:
    if isinstance(v, dict):
        return Refused(as_str(v.get("reason")) or "") if v.get("exported") is False else ParityRecord.from_json(v)
    return v if isinstance(v, str) else None


@dataclass(frozen=True)
class ParityRecord:
    """An artifact in its runtime against the reference model; the JSON of a manifest's ``parity``.

    Attributes:
        runtime: what ran the artifact (``llama-cpp-python``, ``onnxruntime 1.22.0``, …).
        reference: what it was compared with (``transformers float32``, …).
        text: where the held-out text came from (``zoo``, ``builtin-sample``, ``user``).
        seq_lens: the probe lengths, in tokens.
        max_abs_logit_diff: per probe length (``"32"``, ``"128"``), or one figure over all probes (GEM).
        top1_agreement / ppl_reference / ppl_artifact / ppl_change: over the perplexity windows.
        tokens_scored: next-token predictions the perplexities are over.
        windows / tokens / requests: how much a method's check ran (GEM's windows and tokens, hybrid's requests).
        tolerance: the max |Δlogit| the artifact was held to (None: not held to one).
        reference_max_logit: the largest |logit| of the reference over the probes (graph targets): what a float32
            gate scales with (:func:`moetool.export.graph.parity.judge`).
        verdict: as recorded (None in manifests written before it was; :attr:`outcome` derives one).
        decode: the KV-cache decode run (graph targets, MLX).
        wrapper: the torch wrapper that was converted against transformers, per length
            (``export_model_vs_transformers``): tells a conversion error from the runtime's.
        conversion: GGUF: against the artifact's own dequantized weights.
        gate: GGUF's margin gate.
        tokenizer: the runtime's tokenizer against the model's.
        weights: MLX: the quantized modules against their sources.
        routes: route-level figures (GEM, hybrid).
        runtime_not_run: why the artifact's own runtime was not run (Core ML off macOS: the figures are the
            converted wrapper's).
        bundle: a bundle's router and members.
        extra: figures the record does not name (a method's own), kept as written.
    """

    runtime: str | None = None
    reference: str | None = None
    text: str | None = None
    seq_lens: tuple[int, ...] | None = None
    max_abs_logit_diff: dict[str, float] | float | None = None
    top1_agreement: float | None = None
    ppl_reference: float | None = None
    ppl_artifact: float | None = None
    ppl_change: float | None = None
    tokens_scored: int | None = None
    windows: int | None = None
    tokens: int | None = None
    requests: int | None = None
    tolerance: float | None = None
    reference_max_logit: float | None = None
    verdict: Verdict | None = None
    decode: DecodeCheck | None = None
    wrapper: dict[str, float] | None = None
    conversion: ConversionCheck | None = None
    gate: GateReport | None = None
    tokenizer: TokenizerCheck | None = None
    weights: RoundingCheck | None = None
    routes: RouteCheck | None = None
    runtime_not_run: str | None = None
    bundle: BundleParity | None = None
    extra: JsonObject = field(default_factory=dict)

    def with_figures(self, figures: Measured) -> ParityRecord:
        """This record with ``figures`` (max |Δlogit| per length, top-1, perplexities), rounded as manifests hold
        them."""
        return replace(
            self,
            max_abs_logit_diff=dict(figures.max_abs_logit_diff),
            top1_agreement=round(figures.top1_agreement, 6),
            ppl_reference=round(figures.ppl_reference, 4),
            ppl_artifact=round(figures.ppl_artifact, 4),
            ppl_change=round(figures.ppl_change, 6),
        )

    @property
    def worst_logit_diff(self) -> float | None:
        """The largest |Δlogit| over every probe length and the cached decode (None where none was measured)."""
        d = self.max_abs_logit_diff
        values = list(d.values()) if isinstance(d, dict) else [] if d is None else [d]
        if self.decode is not None:
            values.append(self.decode.max_abs_logit_diff)
        return max(values) if values else None

    @property
    def outcome(self) -> Verdict:
        """The verdict as recorded; for an older manifest, the gate's, else the tolerance's, else ``reported``."""
        if self.verdict is not None:
            return self.verdict
        if self.gate is not None:
            return "pass" if self.gate.passed else "fail"
        worst = self.worst_logit_diff
        if self.tolerance is not None and worst is not None:
            return "pass" if worst <= self.tolerance else "fail"
        return "reported"

    def judged(self, tolerance: float | None) -> ParityRecord:
        """This record held to ``tolerance`` (max |Δlogit|; None: the gate's verdict, else ``reported``)."""
        held = replace(self, tolerance=tolerance, verdict=None)
        return replace(held, verdict=held.outcome)

    def to_json(self) -> JsonObject:
        """The manifest's ``parity`` object: the keys that hold a figure, in the order manifests have them."""
        doc: JsonObject = {}
        put(doc, "runtime", self.runtime)
        put(doc, "reference", self.reference)
        if self.tokenizer is not None:
            self.tokenizer.write(doc)
        put(doc, "weights", self.weights.to_json() if self.weights is not None else None)
        put(doc, "seq_lens", list(self.seq_lens) if self.seq_lens is not None else None)
        for key, count in (("windows", self.windows), ("tokens", self.tokens), ("requests", self.requests)):
            put(doc, key, count)
        put(doc, "tokens_scored", self.tokens_scored)
        d = self.max_abs_logit_diff
        put(doc, "max_abs_logit_diff", dict(d) if isinstance(d, dict) else d)
        put(doc, "export_model_vs_transformers", dict(self.wrapper) if self.wrapper is not None else None)
        put(doc, "decode", self.decode.to_json() if self.decode is not None else None)
        put(doc, "top1_agreement", self.top1_agreement)
        put(doc, "ppl_reference", self.ppl_reference)
        put(doc, "ppl_artifact", self.ppl_artifact)
        put(doc, "ppl_change", self.ppl_change)
        if self.routes is not None:
            self.routes.write(doc)
        put(doc, "conversion", self.conversion.to_json() if self.conversion is not None else None)
        put(doc, "gate", self.gate.to_json() if self.gate is not None else None)
        put(doc, "core_ml_runtime", self.runtime_not_run)
        put(doc, "text", self.text)
        put(doc, "reference_max_logit", self.reference_max_logit)
        put(doc, "tolerance", self.tolerance)
        put(doc, "verdict", self.verdict)
        if self.bundle is not None:
            doc |= self.bundle.to_json()
        return doc | self.extra

    @classmethod
    def from_json(cls, doc: Mapping[str, JsonValue]) -> ParityRecord:
        """The record of a manifest's ``parity`` object (any exporter's layout, old or new); keys it does not name
        are kept in :attr:`extra`.

        Raises:
            TypeError: ``gate`` is not a gate report.
        """
        d = doc.get("max_abs_logit_diff")
        gate = doc.get("gate")
        seq_lens = doc.get("seq_lens")
        bundle = BundleParity.from_json(doc)
        known = _KNOWN | ({"router", "members"} if bundle is not None else set())
        return cls(
            runtime=as_str(doc.get("runtime")),
            reference=as_str(doc.get("reference")),
            text=as_str(doc.get("text")),
            seq_lens=tuple(as_ints(seq_lens)) if isinstance(seq_lens, list) else None,
            max_abs_logit_diff=as_floats(d) if isinstance(d, dict) else as_float(d),
            top1_agreement=as_float(doc.get("top1_agreement")),
            ppl_reference=as_float(doc.get("ppl_reference")),
            ppl_artifact=as_float(doc.get("ppl_artifact")),
            ppl_change=as_float(doc.get("ppl_change")),
            tokens_scored=as_int(doc.get("tokens_scored")),
            windows=as_int(doc.get("windows")),
            tokens=as_int(doc.get("tokens")),
            requests=as_int(doc.get("requests")),
            tolerance=as_float(doc.get("tolerance")),
            reference_max_logit=as_float(doc.get("reference_max_logit")),
            verdict=_verdict(doc.get("verdict")),
            decode=DecodeCheck.from_json(doc.get("decode")),
            wrapper=as_floats(doc.get("export_model_vs_transformers")),
            conversion=ConversionCheck.from_json(doc.get("conversion")),
            gate=GateReport.from_json(gate) if isinstance(gate, dict) else None,
            tokenizer=TokenizerCheck.read(doc),
            weights=RoundingCheck.from_json(doc.get("weights")),
            routes=RouteCheck.read(doc),
            runtime_not_run=as_str(doc.get("core_ml_runtime")),
            bundle=bundle,
            extra={k: v for k, v in doc.items() if k not in known},
        )


# every key ParityRecord.from_json reads into a field (a bundle's ``router``/``members`` aside); others go to ``extra``
_KNOWN = {
    "runtime", "reference", "text", "seq_lens", "max_abs_logit_diff", "top1_agreement", "ppl_reference",
    "ppl_artifact", "ppl_change", "tokens_scored", "windows", "tokens", "requests", "tolerance", "verdict", "decode",
    "reference_max_logit",
    "export_model_vs_transformers", "conversion", "gate", "tokenizer_match", "tokenizer_probes",
    "tokenizer_mismatches", "weights", "core_ml_runtime", *ROUTE_KEYS.values(),
}  # fmt: skip


def _verdict(v: JsonValue) -> Verdict | None:
    for verdict in VERDICTS:
        if v == verdict:
            return verdict
    return None


def parity_of(value: JsonValue) -> ParityRecord | str | None:
    """A manifest's ``parity`` read back: the record, the reason it was not verified, or None where it has none."""
    if isinstance(value, dict):
        return ParityRecord.from_json(value)
    if isinstance(value, str):
        return value
    return None
