"""The hybrid method's JSON documents as types: ``hybrid.json`` (the model's metadata), the held-out figures in it,
and ``pareto.json`` (the sweep). Each is the document itself (a ``TypedDict``), so it is written with
``json.dumps`` and read by key exactly as the file on disk; :func:`model_meta_from_json` checks a file read back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NotRequired, TypedDict

from moetool.errors import MoetoolError
from moetool.io.jsontypes import JsonObject, JsonValue

SweepParameter = Literal["lambda_penalty", "threshold", "cost_weight"]


def sweep_parameter(name: str) -> SweepParameter:
    """``name`` as a loss weight the sweep may set.

    Raises:
        MoetoolError: ``name`` is not lambda_penalty, threshold or cost_weight.
    """
    if name == "lambda_penalty":
        return "lambda_penalty"
    if name == "threshold":
        return "threshold"
    if name == "cost_weight":
        return "cost_weight"
    raise MoetoolError(f"sweep parameter {name!r} is not lambda_penalty, threshold or cost_weight")


class ChoiceFigures(TypedDict):
    """Quality and expected latency of one hard routing of the held-out requests (``training.evaluate_choice``).

    The two ``by`` maps are keyed by expert index and domain id (integers; strings once written as JSON).
    """

    nll: float
    perplexity: float
    costly_share: float
    expected_latency_ms: float
    mean_length_by_expert: dict[int, float | None]
    costly_share_by_domain: dict[int, float]
    soft_nll: NotRequired[float]  # a router's row: its soft mixture's NLL
    # when the sweep timed requests: measured on a baseline's row, the whole LatencyCheck on a router's
    measured_latency_ms: NotRequired[float]
    sum_share_latency_ms: NotRequired[float]
    sum_share_mean_latency_ms: NotRequired[float]
    router_overhead_ms: NotRequired[float]
    latency_check: NotRequired[bool]


class LatencyCheck(TypedDict):
    """The routed system timed live against the sum of its parts (``pareto.latency_check``)."""

    measured_latency_ms: float
    sum_share_latency_ms: float
    sum_share_mean_latency_ms: float
    router_overhead_ms: float
    latency_check: bool


class SweepRow(ChoiceFigures):
    """One router of the sweep: the swept weight's value (under its own name), its figures, its timing check."""

    lambda_penalty: NotRequired[float]
    threshold: NotRequired[float]
    cost_weight: NotRequired[float]


class SweepTiming(TypedDict):
    repeats: int
    threads: int
    clock: str
    tolerance: float
    runtime: str | None
    omp_wait_policy: str | None
    note: str


class SweepResult(TypedDict):
    """``pareto.json``."""

    parameter: SweepParameter
    costly: str
    experts: list[str]
    granularity: str
    device: str
    held_out_requests: int
    timed_requests: int
    timing: SweepTiming
    loss: JsonObject
    baselines: dict[str, ChoiceFigures]
    rows: list[SweepRow]
    oracle_definition: str


class HeldOut(TypedDict):
    """``hybrid.json``'s ``held_out``: the router, each expert alone and the oracle on the held-out requests."""

    requests: int
    rows: dict[str, ChoiceFigures]


class FeatureLayoutDoc(TypedDict):
    length: bool
    n_domains: int
    hidden_dim: int
    max_length: int


class RouterConfig(TypedDict):
    """``hybrid.json``'s ``router``: what the router reads and how it decides."""

    features: list[str]
    layout: FeatureLayoutDoc
    domains: list[str]
    in_features: int
    hidden_size: int
    utility_head: bool
    decision: str
    utility_threshold: float
    granularity: str
    encoder: str | None
    encoder_layers: int
    parameters: int


class TokenizerCheck(TypedDict):
    """What ``experts.check_tokenizers`` verified: the shared vocabulary's size and special ids."""

    vocab_size: int
    special_ids: dict[str, int | None]
    probes: int
    identical: bool


class ExpertRow(TypedDict):
    name: str
    source: str
    path: str
    model_type: str
    kind: str


class ModelMeta(TypedDict):
    """``hybrid.json``."""

    format: int
    method: Literal["hybrid"]
    name: str
    experts: list[ExpertRow]
    costly: str
    router: RouterConfig
    loss: JsonObject
    tokenizer: TokenizerCheck
    held_out: Mapping[str, object]  # a HeldOut when written; carried, never read back
    training: JsonObject
    profile_device: str


def _object(doc: JsonValue, where: str) -> JsonObject:
    if not isinstance(doc, dict):
        raise MoetoolError(f"{where}: not a JSON object")
    return doc


def _int(doc: JsonObject, key: str, where: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise MoetoolError(f"{where}.{key}: {value!r} is not an integer")
    return value


def _str(doc: JsonObject, key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise MoetoolError(f"{where}.{key}: {value!r} is not a string")
    return value


def _router_from_json(doc: JsonObject, where: str) -> RouterConfig:
    lay = _object(doc.get("layout"), f"{where}.layout")
    encoder = doc.get("encoder")
    threshold = doc.get("utility_threshold")
    features = doc.get("features")
    domains = doc.get("domains")
    return RouterConfig(
        features=[f for f in features if isinstance(f, str)] if isinstance(features, list) else [],
        layout=FeatureLayoutDoc(
            length=bool(lay.get("length")),
            n_domains=_int(lay, "n_domains", f"{where}.layout"),
            hidden_dim=_int(lay, "hidden_dim", f"{where}.layout"),
            max_length=_int(lay, "max_length", f"{where}.layout"),
        ),
        domains=[d for d in domains if isinstance(d, str)] if isinstance(domains, list) else [],
        in_features=_int(doc, "in_features", where),
        hidden_size=_int(doc, "hidden_size", where),
        utility_head=bool(doc.get("utility_head")),
        decision=_str(doc, "decision", where),
        utility_threshold=float(threshold) if isinstance(threshold, int | float) else 0.0,
        granularity=_str(doc, "granularity", where),
        encoder=encoder if isinstance(encoder, str) else None,
        encoder_layers=_int(doc, "encoder_layers", where),
        parameters=_int(doc, "parameters", where),
    )


def _tokenizer_from_json(doc: JsonObject, where: str) -> TokenizerCheck:
    special = _object(doc.get("special_ids", {}), f"{where}.special_ids")
    return TokenizerCheck(
        vocab_size=_int(doc, "vocab_size", where),
        special_ids={k: v if isinstance(v, int) else None for k, v in special.items()},
        probes=_int(doc, "probes", where) if "probes" in doc else 0,
        identical=bool(doc.get("identical", True)),
    )


def model_meta_from_json(doc: JsonValue, where: str) -> ModelMeta:
    """``hybrid.json`` read back and checked: the fields the router, the export and the CLI use.

    Raises:
        MoetoolError: naming ``where`` and the field that is missing or of the wrong type.
    """
    meta = _object(doc, where)
    experts = meta.get("experts")
    if not isinstance(experts, list) or not experts:
        raise MoetoolError(f"{where}.experts: missing (a list of the experts)")
    rows = []
    for i, e in enumerate(experts):
        e_doc = _object(e, f"{where}.experts.{i}")
        at = f"{where}.experts.{i}"
        rows.append(
            ExpertRow(
                name=_str(e_doc, "name", at),
                source=_str(e_doc, "source", at),
                path=_str(e_doc, "path", at),
                model_type=_str(e_doc, "model_type", at),
                kind=_str(e_doc, "kind", at),
            )
        )
    loss, training, held_out = meta.get("loss"), meta.get("training"), meta.get("held_out")
    return ModelMeta(
        format=_int(meta, "format", where),
        method="hybrid",
        name=_str(meta, "name", where),
        experts=rows,
        costly=_str(meta, "costly", where),
        router=_router_from_json(_object(meta.get("router"), f"{where}.router"), f"{where}.router"),
        loss=loss if isinstance(loss, dict) else {},
        tokenizer=_tokenizer_from_json(_object(meta.get("tokenizer"), f"{where}.tokenizer"), f"{where}.tokenizer"),
        held_out=held_out if isinstance(held_out, dict) else {},
        training=training if isinstance(training, dict) else {},
        profile_device=str(meta.get("profile_device", "")),
    )
