"""``latency_profile.json`` as types: each expert's measured points and their fit ``c(L) = a·L + b·L² + c0``, what
was timed and where; the fit, and the check of a profile read back (one measured on a device)."""

from __future__ import annotations

from typing import NotRequired, TypedDict

import torch

from moetool.errors import MoetoolError
from moetool.io.jsontypes import JsonValue
from moetool.io.narrow import scalar_fields

PROFILE_FORMAT = 1


class _HowTimedBase(TypedDict):
    device: str
    lengths: list[int]
    vocab: int


class HowTimed(_HowTimedBase, total=False):
    """The keyword arguments of :func:`time_profile` and :func:`time_gguf_profile`."""

    repeats: int
    threads: int
    clock_name: str


class LatencyFit(TypedDict):
    """``seconds ≈ a·L + b·L² + c0`` and the fit's largest relative error on its points."""

    a: float
    b: float
    c0: float
    max_rel_error: float


class ExpertTimes(TypedDict):
    """One expert's measured points (``lengths`` tokens → ``seconds``), their fit, and the GGUF timed, if one was."""

    lengths: list[int]
    seconds: list[float]
    fit: LatencyFit
    file: NotRequired[str]


class Machine(TypedDict):
    platform: str
    processor: str


class HowMeasured(TypedDict, total=False):
    """The descriptive fields of ``latency_profile.json``: what was timed, how and when (each optional)."""

    runtime: str
    operation: str
    threads: int
    clock: str
    repeats: int
    measured_at: str


class LatencyProfile(HowMeasured):
    """``latency_profile.json``: what was timed, how and where, and each expert's points and fit. A profile measured
    on a device needs only ``device`` and ``experts`` (its fits are recomputed)."""

    format: int
    device: str
    machine: NotRequired[Machine]
    experts: dict[str, ExpertTimes]


def fit_latency(lengths: list[int], seconds: list[float]) -> LatencyFit:
    """Non-negative least-squares fit of ``seconds ≈ a·L + b·L² + c0``; returns a, b, c0 and the max relative error."""
    if len(lengths) != len(seconds) or len(lengths) < 2:
        raise ValueError("need at least two (length, seconds) points of equal count")
    x = torch.tensor(lengths, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    cols = {"a": x, "b": x * x, "c0": torch.ones_like(x)}
    active = list(cols)
    coef: dict[str, float] = {}
    while active:
        design = torch.stack([cols[k] for k in active], dim=1)
        sol = torch.linalg.lstsq(design, y.unsqueeze(1)).solution.squeeze(1)
        coef = {k: float(v) for k, v in zip(active, sol, strict=True)}
        negative = [k for k, v in coef.items() if v < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda k: coef[k]))
    fit = LatencyFit(a=coef.get("a", 0.0), b=coef.get("b", 0.0), c0=coef.get("c0", 0.0), max_rel_error=0.0)
    pred = [latency_at(fit, n) for n in lengths]
    fit["max_rel_error"] = max(abs(p - s) / s for p, s in zip(pred, seconds, strict=True))
    return fit


def latency_at(fit: LatencyFit, length: float) -> float:
    """Seconds for a request of ``length`` tokens under a fit."""
    return fit["a"] * length + fit["b"] * length * length + fit["c0"]


def profile_from_json(data: JsonValue, expert_names: list[str], *, where: str) -> LatencyProfile:
    """A parsed profile document checked, each of ``expert_names`` refitted from its points (other experts and
    unknown keys are dropped; the optional descriptive fields are kept where they have their type).

    Raises:
        MoetoolError: naming ``where`` and the field that is missing or wrong.
    """
    experts = data.get("experts") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(experts, dict):
        raise MoetoolError(f"{where}: experts: missing (a mapping of expert name → lengths, seconds)")
    device = data.get("device")
    if not isinstance(device, str):
        raise MoetoolError(f"{where}: device: missing (the name of the device it was measured on)")
    fmt = data.get("format", PROFILE_FORMAT)
    prof = LatencyProfile(format=fmt if isinstance(fmt, int) else PROFILE_FORMAT, device=device, experts={})
    prof.update(scalar_fields(HowMeasured, data))
    machine = data.get("machine")
    if isinstance(machine, dict) and isinstance(machine.get("platform"), str):
        prof["machine"] = Machine(platform=str(machine["platform"]), processor=str(machine.get("processor", "")))
    for name in expert_names:
        prof["experts"][name] = _expert_from_json(experts.get(name), name, list(experts), where)
    return prof


def _expert_from_json(entry: JsonValue, name: str, names: list[str], where: str) -> ExpertTimes:
    if not isinstance(entry, dict):
        raise MoetoolError(f"{where}: experts.{name}: missing (profile has {', '.join(names) or 'none'})")
    lengths, secs = entry.get("lengths"), entry.get("seconds")
    if not (isinstance(lengths, list) and isinstance(secs, list) and len(lengths) == len(secs) >= 2):
        raise MoetoolError(f"{where}: experts.{name}: needs 'lengths' and 'seconds' lists of equal length ≥ 2")
    points = [v for v in [*lengths, *secs] if isinstance(v, int | float) and not isinstance(v, bool) and v > 0]
    if len(points) != 2 * len(lengths):
        raise MoetoolError(f"{where}: experts.{name}: lengths and seconds must be positive numbers")
    ls, ss = [int(v) for v in points[: len(lengths)]], [float(v) for v in points[len(lengths) :]]
    times = ExpertTimes(lengths=ls, seconds=ss, fit=fit_latency(ls, ss))
    if isinstance(file := entry.get("file"), str):
        times["file"] = file
    return times
