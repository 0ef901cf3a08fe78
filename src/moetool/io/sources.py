"""Resolve a recipe's model reference (local dir, cached Hugging Face repo id, ``zoo:NAME``) to a directory.

A ``SCHEME:NAME`` reference belongs to a source plugin: a :class:`SourceResolver` registered in
:data:`moetool.registry.SOURCES` (the zoo's is ``moetool.zoo.plugin:SOURCE``). The zoo sits above every layer that
reads it (io, train, export), so those reach it through :func:`source_resolver` alone, never by import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from moetool import registry
from moetool.errors import MoetoolError, PreflightError, SourceError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedSource:
    """A model reference and the local directory it resolved to.

    Attributes:
        ref: the reference as written in the recipe.
        path: the local directory holding config.json and weights.
        kind: ``local``, ``hf-cache`` or the scheme of a ``SCHEME:NAME`` reference (``zoo``).
        revision: the Hub commit of a cached snapshot, else None.
    """

    ref: str
    path: Path
    kind: str
    revision: str | None = None


class SourceResolver(Protocol):
    """A model-source plugin: the models behind ``SCHEME:NAME`` and the text domains they were trained on.

    Attributes:
        scheme: the references' prefix (``zoo``).
        domains: the text domains, in the order held-out text interleaves them.
    """

    scheme: str
    domains: tuple[str, ...]

    def resolve(self, name: str) -> Path:
        """The local folder of model ``name``; raises a MoetoolError naming what to build when it is missing."""
        ...

    def domain_text(self, domain: str, split: Literal["train", "valid"]) -> str:
        """One domain's training or held-out text; raises a MoetoolError when it cannot be read."""
        ...


def source_resolver(scheme: str) -> SourceResolver:
    """The registered source plugin of ``scheme`` (:data:`moetool.registry.SOURCES`).

    Raises:
        UnknownPluginError: no plugin is registered for ``scheme`` (with "did you mean").
    """
    if scheme not in registry.SOURCES:
        raise registry.UnknownPluginError(
            f"unknown source scheme {scheme!r} ({registry.did_you_mean(scheme, registry.SOURCES)})"
        )
    resolver: SourceResolver = registry.load(registry.SOURCES[scheme])
    return resolver


def resolve_source(ref: str, *, relative_to: Path | None = None) -> ResolvedSource:
    """Resolve ``ref`` without touching the network.

    Relative paths are tried against ``relative_to`` (the recipe's directory) first, then the working directory.

    Raises:
        SourceError: nothing local matches, naming what was tried.
    """
    scheme, sep, name = ref.partition(":")
    if sep and scheme in registry.SOURCES:
        try:
            return ResolvedSource(ref, source_resolver(scheme).resolve(name), scheme)
        except MoetoolError as exc:
            raise SourceError(str(exc)) from None
    candidates = [Path(ref).expanduser()]
    if relative_to is not None and not Path(ref).is_absolute():
        candidates.insert(0, relative_to / ref)
    for c in candidates:
        if c.is_dir():
            return ResolvedSource(ref, c.resolve(), "local")
    if _REPO_ID.match(ref):
        from huggingface_hub import snapshot_download

        try:
            snap = Path(snapshot_download(ref, local_files_only=True))
        except Exception:
            raise SourceError(
                f"{ref!r}: not a local directory and not in the local Hugging Face cache "
                "(moetool never downloads; run `hf download` first where you have network)"
            ) from None
        return ResolvedSource(ref, snap, "hf-cache", revision=snap.name)
    tried = ", ".join(str(c) for c in candidates)
    raise SourceError(f"{ref!r}: no such model directory (tried {tried}); use a directory, a repo id or zoo:NAME")


def resolve_sources(refs: dict[str, tuple[str, str]], *, relative_to: Path | None = None) -> dict[str, ResolvedSource]:
    """Resolve every model a recipe names: ``label -> (recipe field, reference)``.

    Raises:
        PreflightError: every reference that does not resolve, one per line, each naming its recipe field.
    """
    problems: list[str] = []
    sources: dict[str, ResolvedSource] = {}
    for label, (fieldname, ref) in refs.items():
        try:
            sources[label] = resolve_source(ref, relative_to=relative_to)
        except MoetoolError as exc:
            problems.append(f"{fieldname}: {exc}")
    if problems:
        raise PreflightError("\n".join(problems))
    return sources
