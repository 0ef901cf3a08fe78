"""The parts of a parity record (:class:`moetool.export.parity.ParityRecord`): the tokenizer check, the cached
decode, GGUF's conversion check, MLX's rounding check and route-level figures, each with the JSON manifests hold.

Reading narrows every value with ``isinstance`` (a manifest is parsed JSON); a figure of the wrong type reads as
missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Protocol, TypedDict

from moetool.io.jsontypes import JsonObject, JsonValue

__all__ = [
    "ROUTE_KEYS",
    "ConversionCheck",
    "DecodeCheck",
    "Measured",
    "RoundingCheck",
    "RouteCheck",
    "TokenizerCheck",
    "TokenizerMismatch",
    "as_float",
    "as_floats",
    "as_int",
    "as_ints",
    "as_str",
    "put",
]


def as_str(v: JsonValue) -> str | None:
    """``v`` if it is a string, else None."""
    return v if isinstance(v, str) else None


def as_int(v: JsonValue) -> int | None:
    """``v`` if it is an integer (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def as_float(v: JsonValue) -> float | None:
    """``v`` as a float if it is a number (not a bool), else None."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def as_floats(v: JsonValue) -> dict[str, float] | None:
    """``{"32": 1e-5, …}`` when ``v`` is an object of numbers, else None."""
    if not isinstance(v, dict):
        return None
    out: dict[str, float] = {}
    for k, x in v.items():
        f = as_float(x)
        if f is None:
            return None
        out[k] = f
    return out


def as_ints(v: JsonValue) -> list[int]:
    """The integers of a list (empty when ``v`` is not one)."""
    return [x for x in v if isinstance(x, int) and not isinstance(x, bool)] if isinstance(v, list) else []


def put(doc: JsonObject, key: str, value: JsonValue) -> None:
    """``doc[key] = value`` unless ``value`` is None (a record writes only the figures it holds)."""
    if value is not None:
        doc[key] = value


class Measured(Protocol):
    """A runtime's figures against a reference on the same ids (:class:`moetool.export.heldout.Agreement`)."""

    @property
    def max_abs_logit_diff(self) -> dict[str, float]: ...
    @property
    def top1_agreement(self) -> float: ...
    @property
    def ppl_reference(self) -> float: ...
    @property
    def ppl_artifact(self) -> float: ...
    @property
    def ppl_change(self) -> float: ...


class TokenizerMismatch(TypedDict):
    """A probe string whose llama.cpp ids differ from Hugging Face's (the first 32 ids of each)."""

    text: str
    hf: list[int]
    llama_cpp: list[int]


@dataclass(frozen=True)
class TokenizerCheck:
    """The runtime's tokenizer against the model's: ``match``, how many ``probes`` (None: not recorded) and the
    ``mismatches`` (None where the layout has no list, as MLX's)."""

    match: bool
    probes: int | None = None
    mismatches: tuple[TokenizerMismatch, ...] | None = None

    def write(self, doc: JsonObject) -> None:
        """Add ``tokenizer_match``, ``tokenizer_probes`` and ``tokenizer_mismatches`` (those it holds) to ``doc``."""
        doc["tokenizer_match"] = self.match
        put(doc, "tokenizer_probes", self.probes)
        if self.mismatches is not None:
            doc["tokenizer_mismatches"] = [
                {"text": m["text"], "hf": list(m["hf"]), "llama_cpp": list(m["llama_cpp"])} for m in self.mismatches
            ]

    @classmethod
    def read(cls, doc: Mapping[str, JsonValue]) -> TokenizerCheck | None:
        """The check a parity object holds (None where it has no ``tokenizer_match``)."""
        match = doc.get("tokenizer_match")
        if not isinstance(match, bool):
            return None
        raw = doc.get("tokenizer_mismatches")
        mismatches = None
        if isinstance(raw, list):
            mismatches = tuple(
                TokenizerMismatch(
                    text=as_str(m.get("text")) or "", hf=as_ints(m.get("hf")), llama_cpp=as_ints(m.get("llama_cpp"))
                )
                for m in raw
                if isinstance(m, dict)
            )
        return cls(match, as_int(doc.get("tokenizer_probes")), mismatches)


@dataclass(frozen=True)
class DecodeCheck:
    """A decode run with the KV cache: ``prefill_tokens`` prefilled, then ``steps`` one-token steps; the worst
    |Δlogit| over all of them against a full forward pass."""

    prefill_tokens: int
    steps: int
    max_abs_logit_diff: float

    def to_json(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_json(cls, v: JsonValue) -> DecodeCheck | None:
        """The check ``parity.decode`` holds (None where it is not one)."""
        if not isinstance(v, dict):
            return None
        worst = as_float(v.get("max_abs_logit_diff"))
        if worst is None:
            return None
        return cls(as_int(v.get("prefill_tokens")) or 0, as_int(v.get("steps")) or 0, worst)


@dataclass(frozen=True)
class ConversionCheck:
    """The runtime against transformers on the artifact's own (dequantized) weights: the conversion alone, without
    what the precision plan costs (GGUF's ``parity.conversion``)."""

    reference: str
    max_abs_logit_diff: dict[str, float]
    top1_agreement: float
    ppl_reference: float
    ppl_artifact: float
    ppl_change: float

    def to_json(self) -> JsonObject:
        return {
            "max_abs_logit_diff": dict(self.max_abs_logit_diff),
            "top1_agreement": self.top1_agreement,
            "ppl_reference": self.ppl_reference,
            "ppl_artifact": self.ppl_artifact,
            "ppl_change": self.ppl_change,
            "reference": self.reference,
        }

    @classmethod
    def of(cls, figures: Measured, reference: str) -> ConversionCheck:
        """``figures`` against ``reference``, rounded as manifests hold them."""
        return cls(
            reference=reference,
            max_abs_logit_diff=dict(figures.max_abs_logit_diff),
            top1_agreement=round(figures.top1_agreement, 6),
            ppl_reference=round(figures.ppl_reference, 4),
            ppl_artifact=round(figures.ppl_artifact, 4),
            ppl_change=round(figures.ppl_change, 6),
        )

    @classmethod
    def from_json(cls, v: JsonValue) -> ConversionCheck | None:
        """The check ``parity.conversion`` holds (None where it is not one)."""
        if not isinstance(v, dict):
            return None
        return cls(
            reference=as_str(v.get("reference")) or "",
            max_abs_logit_diff=as_floats(v.get("max_abs_logit_diff")) or {},
            top1_agreement=as_float(v.get("top1_agreement")) or 0.0,
            ppl_reference=as_float(v.get("ppl_reference")) or 0.0,
            ppl_artifact=as_float(v.get("ppl_artifact")) or 0.0,
            ppl_change=as_float(v.get("ppl_change")) or 0.0,
        )


@dataclass(frozen=True)
class RoundingCheck:
    """Quantized modules checked to be their source tensors rounded (MLX's ``parity.weights``)."""

    modules: int
    identical: int
    differing: tuple[str, ...]

    def to_json(self) -> JsonObject:
        return {"modules": self.modules, "identical": self.identical, "differing": list(self.differing)}

    @classmethod
    def from_json(cls, v: JsonValue) -> RoundingCheck | None:
        """The check ``parity.weights`` holds (None where it is not one)."""
        if not isinstance(v, dict):
            return None
        differing = v.get("differing")
        names = tuple(x for x in differing if isinstance(x, str)) if isinstance(differing, list) else ()
        return cls(as_int(v.get("modules")) or 0, as_int(v.get("identical")) or 0, names)


@dataclass(frozen=True)
class RouteCheck:
    """Route-level parity of a routed graph (GEM's token graph and sequence router, hybrid's router): the router's
    probabilities or scores against PyTorch's, and the routes taken. Fields a graph does not report are None."""

    max_abs_prob_diff: float | None = None
    max_abs_score_diff: float | None = None
    mismatches: int | None = None  # tokens routed differently
    mismatches_off_boundary: int | None = None  # of those, where max P is not within rounding of tau
    same_route: int | None = None  # probes the sequence router sends where PyTorch does
    choice_agreement: float | None = None  # share of requests given the same choice
    share: dict[str, float] | None = None  # per route (``general`` and each domain): its share of the tokens

    def write(self, doc: JsonObject) -> None:
        """Add the figures it holds to ``doc``, under the keys of :data:`ROUTE_KEYS`."""
        for name, key in ROUTE_KEYS.items():
            value = getattr(self, name)
            put(doc, key, dict(value) if isinstance(value, dict) else value)

    @classmethod
    def read(cls, doc: Mapping[str, JsonValue]) -> RouteCheck | None:
        """The route figures a parity object holds (None where it has none)."""
        if not any(key in doc for key in ROUTE_KEYS.values()):
            return None
        return cls(
            max_abs_prob_diff=as_float(doc.get("max_abs_prob_diff")),
            max_abs_score_diff=as_float(doc.get("max_abs_score_diff")),
            mismatches=as_int(doc.get("route_mismatches")),
            mismatches_off_boundary=as_int(doc.get("route_mismatches_off_boundary")),
            same_route=as_int(doc.get("same_route")),
            choice_agreement=as_float(doc.get("choice_agreement")),
            share=as_floats(doc.get("route_share")),
        )


# RouteCheck's fields and their keys in a parity object
ROUTE_KEYS = {
    "max_abs_prob_diff": "max_abs_prob_diff",
    "max_abs_score_diff": "max_abs_score_diff",
    "mismatches": "route_mismatches",
    "mismatches_off_boundary": "route_mismatches_off_boundary",
    "same_route": "same_route",
    "choice_agreement": "choice_agreement",
    "share": "route_share",
}
