"""GEM's JSON documents as types: ``gem-report.json`` (what the merge measured: assembly parity, memory, SCAR, the
router's training and its held-out table over tau, QAT) and ``moetool route --log``'s rows. Each is the document
itself (a ``TypedDict``), written with ``json.dumps`` exactly as the file on disk holds it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NotRequired, TypedDict

from moetool.io.jsontypes import JsonObject


class TauRow(TypedDict):
    """The router at one threshold: shares of held-out items sent to general (``fallback``), routed right, routed
    wrong, the accuracy among those routed (None when none is) and the fallback share per true domain."""

    tau: float
    fallback: float
    routed_accuracy: float | None
    correct: float
    wrong: float
    fallback_by_domain: dict[str, float]


class TauTable(TypedDict):
    """The router's held-out quality as tau varies (``router`` in gem-report.json)."""

    items: int
    argmax_accuracy: float
    by_tau: list[TauRow]


class RouterTraining(TypedDict):
    """The router's training: its loss every 10 steps as ``(step, loss)`` pairs, the time, and (token level) how many
    frozen weights were checked unchanged by hash."""

    steps: int
    loss_curve: list[tuple[int, float]]
    seconds: float
    frozen_unchanged: NotRequired[int]


class ScarFit(TypedDict):
    clusters: int
    fitted_on_tokens: int


class QatStep(TypedDict):
    step: int
    domain: str
    task: float
    quant: float
    kd: float
    total: float


class QatReport(TypedDict):
    """QAT's loss terms every 5 steps, what it trained; with the held-out perplexity per domain before and after
    (float and fake-quantized) once :func:`moetool.methods.gem.training.token_qat` has measured them."""

    steps: int
    trainable: list[str]
    trainable_params: int
    curve: list[QatStep]
    seconds: float
    before: NotRequired[dict[str, dict[str, float]]]
    after: NotRequired[dict[str, dict[str, float]]]
    frozen_unchanged: NotRequired[int]
    eval_tokens_per_domain: NotRequired[int]


class AssemblyReport(TypedDict):
    """``gem-report.json``: token level (assembly parity per pathway, SCAR, QAT) or sequence level."""

    level: str
    memory: MemoryTable
    notes: NotRequired[list[str]]
    assembly_parity: NotRequired[dict[str, float]]
    scar: NotRequired[ScarFit]
    router_training: NotRequired[RouterTraining]
    router: NotRequired[TauTable]
    qat: NotRequired[QatReport]


class RouteDecision(TypedDict):
    """One token's routing decision (``moetool gem route --log``): its pathway, max P(d|x) and every P."""

    pos: int
    token: str
    route: str
    max_p: float
    probs: dict[str, float]


class DeviceMemory(TypedDict):
    """The memory estimate on one device profile (bytes): weights + KV cache + runtime against its budget."""

    context: int
    weights: int
    kv_cache: int
    runtime: int
    total: int
    budget: int
    fits: bool


class MemoryTable(TypedDict):
    """The quantization plan, the weights' bytes under it, the plan by role, and each device's estimate."""

    plan: JsonObject
    weights: int
    by_role: Mapping[str, object]  # the quantization plan's own summary, carried as written
    devices: dict[str, DeviceMemory]
