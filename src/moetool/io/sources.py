"""Resolve a recipe's model reference (local dir, cached Hugging Face repo id, ``zoo:NAME``) to a directory."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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


def resolve_source(ref: str, *, relative_to: Path | None = None) -> ResolvedSource:
    """Resolve ``ref`` without touching the network.

    Relative paths are tried against ``relative_to`` (the recipe's directory) first, then the working directory.

    Raises:
        SourceError: nothing local matches, naming what was tried.
    """
    scheme, sep, name = ref.partition(":")
    if sep and scheme in registry.SOURCE_SCHEMES:
        # the scheme's resolver lives above this layer (the zoo); the registry names it, so io never imports it
        try:
            return ResolvedSource(ref, registry.load(registry.SOURCE_SCHEMES[scheme])(name), scheme)
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
