"""The ``smollm2`` profile's check: held-out perplexity of the base and each expert on each domain, and each expert
at least ``min_gain`` better than the base on its own domain. Printed, and saved in the profile's ``zoo.json``."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from moetool.errors import MoetoolError
from moetool.eval.perplexity import perplexity_matrix, render_matrix
from moetool.io.jsontypes import JsonObject
from moetool.zoo.build import tool_versions
from moetool.zoo.config import BASE_NAME, SMOLLM2, ZOO_JSON, ExpertCheck, ZooRecord
from moetool.zoo.corpora import DOMAINS, DomainSplit
from moetool.zoo.smollm2.experts import Smollm2Config


class GainCheck(ExpertCheck):
    """zoo.json's ``check``: each expert's gain on its own domain and whether all reach ``min_gain``."""

    min_gain: float


class Smollm2ZooMeta(ZooRecord):
    """The ``smollm2`` profile's zoo.json."""

    config: JsonObject
    check: GainCheck


def check_gains(matrix: dict[str, dict[str, float]], min_gain: float) -> GainCheck:
    """Each expert's relative perplexity reduction on its own domain against the base, and what falls short."""
    gains, failures = {}, []
    for d in DOMAINS:
        base, expert = matrix[BASE_NAME][d], matrix[d][d]
        gain = (base - expert) / base
        gains[d] = round(gain, 4)
        if gain < min_gain:
            failures.append(
                f"expert {SMOLLM2}-{d} is {100 * gain:.1f}% better than the base on {d!r} held-out text "
                f"(perplexity {expert:.2f} vs {base:.2f}), below the required {100 * min_gain:.0f}%"
            )
    return {"passed": not failures, "failures": failures, "relative_improvement": gains, "min_gain": min_gain}


def evaluate(
    root: Path,
    splits: dict[str, DomainSplit],
    cfg: Smollm2Config,
    console: Console,
    *,
    training: dict[str, dict[str, float]],
    seconds: float,
) -> Smollm2ZooMeta:
    """The perplexity matrix of ``root``'s base and experts, the check, written to ``root/zoo.json`` (returned).

    Raises:
        MoetoolError: an expert is not ``cfg.min_gain`` better than the base on its own domain (after writing).
    """
    matrix: dict[str, dict[str, float]] = {}
    texts = {d: splits[d].valid for d in DOMAINS}
    for n in (BASE_NAME, *DOMAINS):  # a line per model: the matrix takes minutes and must show it is moving
        start = time.perf_counter()
        matrix |= perplexity_matrix({n: root / n}, texts, seq_len=cfg.eval_seq_len, max_tokens=cfg.eval_max_tokens)
        shown = ", ".join(f"{d} {v:.2f}" for d, v in matrix[n].items())
        console.print(f"held-out perplexity of {SMOLLM2}-{n}: {shown} ({time.perf_counter() - start:.0f} s)")
    check = check_gains(matrix, cfg.min_gain)
    console.print(render_matrix(matrix, f"held-out perplexity, zoo '{SMOLLM2}'"))
    gains = ", ".join(f"{d} {100 * g:+.1f}%" for d, g in check["relative_improvement"].items())
    console.print(f"expert vs base on own domain (perplexity reduction): {gains}", highlight=False)
    meta: Smollm2ZooMeta = {
        "profile": SMOLLM2,
        "config": cfg.to_dict(),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 2),
        "models": [BASE_NAME, *DOMAINS],
        "domains": list(DOMAINS),
        "perplexity": matrix,
        "check": check,
        "training": training,
        "versions": tool_versions(),
    }
    tmp = root / f".{ZOO_JSON}.{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, root / ZOO_JSON)
    if not check["passed"]:
        raise MoetoolError("zoo check failed: " + "; ".join(check["failures"]) + f" (see {root / ZOO_JSON})")
    return meta
