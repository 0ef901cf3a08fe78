"""The zoo corpora pinned: which documents each domain is made of, by content hash, the same on every machine.

The corpora are read from text already on the machine (:mod:`moetool.zoo.corpora`), and that text varies: the legal
domain gathers licence files of whatever packages are installed, the code domain is the running Python's
documentation. ``corpora.lock.json`` (next to this module) fixes each domain's documents as ``sha256 -> characters``
of their cleaned text. A build uses exactly those documents: one found on this machine that is not pinned is left
out, one pinned and not found is reported, and when more than :data:`MAX_MISSING` of a domain's pinned text is
missing the build refuses (its figures would not be comparable). ``MOETOOL_CORPUS=machine`` uses this machine's text
as found instead, and every zoo records which it used.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TypedDict

from moetool.errors import MoetoolError

PIN_FILE = Path(__file__).with_name("corpora.lock.json")
MAX_MISSING = 0.2  # share of a domain's pinned characters that may be missing before a build refuses
ENV = "MOETOOL_CORPUS"

__all__ = ["MAX_MISSING", "PIN_FILE", "PinStatus", "digest", "pin_id", "pinned", "select", "write_pins"]


def digest(text: str) -> str:
    """A document's pin: the sha256 of its cleaned text, hex."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class _PinFile(TypedDict):
    domains: dict[str, dict[str, int]]  # domain -> document sha256 -> characters


@cache
def _load(path: Path) -> dict[str, dict[str, int]]:
    try:
        data: _PinFile = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MoetoolError(f"{path}: the pinned corpus list cannot be read ({exc}); reinstall moetool") from exc
    return {d: {h: int(n) for h, n in docs.items()} for d, docs in data["domains"].items()}


def _mode() -> str:
    """``pinned`` (default) or ``machine``, from :data:`ENV`."""
    mode = os.environ.get(ENV, "pinned")
    if mode not in ("pinned", "machine"):
        raise MoetoolError(f"{ENV}={mode!r}: use 'pinned' (default) or 'machine'")
    return mode


def pin_id() -> str:
    """What the corpora are: ``machine`` (as found) or the sha256 of the pin file (a zoo built with other pins is
    rebuilt)."""
    if _mode() == "machine":
        return "machine"
    return hashlib.sha256(PIN_FILE.read_bytes()).hexdigest()


def pinned(domain: str) -> dict[str, int] | None:
    """``domain``'s pinned documents (sha256 -> characters), or None when ``MOETOOL_CORPUS=machine``."""
    if _mode() == "machine":
        return None
    pins = _load(PIN_FILE)
    if domain not in pins:
        raise MoetoolError(f"{PIN_FILE} pins no documents for domain {domain!r}")
    return pins[domain]


@dataclass(frozen=True)
class PinStatus:
    """How a domain's documents compare with its pins: ``used`` documents and their sha256 over all of them in
    order; pinned ``missing`` (count, characters); found but not pinned, ``ignored``."""

    domain: str
    mode: str
    used: int
    sha256: str
    missing: int = 0
    missing_chars: int = 0
    pinned_chars: int = 0
    ignored: int = 0

    def to_json(self) -> dict[str, str | int]:
        return dict(self.__dict__)

    @property
    def warning(self) -> str | None:
        if self.missing == 0:
            return None
        share = self.missing_chars / max(self.pinned_chars, 1)
        return (
            f"corpus {self.domain!r}: {self.missing} pinned document(s) ({share:.1%} of its text) are not on this "
            "machine: figures may differ from the documented ones"
        )


def _corpus_sha(docs: list[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(digest(d).encode())
    return h.hexdigest()


def select(domain: str, docs: list[str], how_to_get: str) -> tuple[list[str], PinStatus]:
    """The pinned documents among ``docs`` (in their order) and how they compare with the pins.

    Raises:
        MoetoolError: more than :data:`MAX_MISSING` of the domain's pinned text is not among ``docs``.
    """
    pins = pinned(domain)
    if pins is None:
        return docs, PinStatus(domain, "machine", len(docs), _corpus_sha(docs))
    kept, seen = [], set()
    for d in docs:
        h = digest(d)
        if h in pins and h not in seen:
            kept.append(d)
            seen.add(h)
    missing = {h: n for h, n in pins.items() if h not in seen}
    total = sum(pins.values())
    status = PinStatus(
        domain,
        "pinned",
        len(kept),
        _corpus_sha(kept),
        missing=len(missing),
        missing_chars=sum(missing.values()),
        pinned_chars=total,
        ignored=len(docs) - len(kept),
    )
    if status.missing_chars > MAX_MISSING * total:
        raise MoetoolError(
            f"corpus {domain!r}: {status.missing} of its {len(pins)} pinned documents "
            f"({status.missing_chars / total:.0%} of its text) are not on this machine, so the zoo would not be the "
            f"documented one; {how_to_get}. Set {ENV}=machine to build from this machine's text anyway."
        )
    return kept, status


def write_pins(docs: dict[str, list[str]], path: Path = PIN_FILE) -> None:
    """Pin ``docs`` (domain -> documents) into ``path`` (the maintainers' ``scripts/pin_corpora.py``)."""
    data = {
        "format": 1,
        "about": "moetool zoo corpora: each domain's documents as sha256 of the cleaned text -> characters",
        "domains": {d: {digest(t): len(t) for t in texts} for d, texts in docs.items()},
    }
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    _load.cache_clear()
