"""Finding what a built zoo holds: its models (``zoo:NAME`` references) and its domains' text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from moetool.errors import MoetoolError
from moetool.io.jsontypes import JsonObject
from moetool.paths import zoo_dir
from moetool.zoo.config import NAMED_PROFILES, ZOO_JSON
from moetool.zoo.corpora import DOMAINS


def read_zoo_json(root: Path) -> JsonObject | None:
    """``root``'s zoo.json, or None where there is none (or it does not parse: not a finished zoo)."""
    path = root / ZOO_JSON
    if not path.is_file():
        return None
    try:
        data: JsonObject = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def zoo_check_passed(meta: JsonObject) -> bool:
    """Whether zoo.json ``meta`` records a passed expert check."""
    check = meta.get("check")
    return isinstance(check, dict) and bool(check.get("passed"))


def zoo_listed_models(meta: JsonObject) -> list[str]:
    """The models zoo.json ``meta`` lists (empty when it lists none)."""
    models = meta.get("models")
    return [m for m in models if isinstance(m, str)] if isinstance(models, list) else []


def zoo_perplexity(meta: JsonObject) -> dict[str, dict[str, float]]:
    """zoo.json ``meta``'s held-out perplexity matrix, ``matrix[model][domain]`` (empty when it has none)."""
    matrix = meta.get("perplexity")
    if not isinstance(matrix, dict):
        return {}
    return {
        m: {d: v for d, v in row.items() if isinstance(v, int | float)}
        for m, row in matrix.items()
        if isinstance(row, dict)
    }


def zoo_models(profile: str = "default") -> list[str]:
    """Names of the models in the zoo of ``profile`` (empty if it is not built)."""
    root = zoo_dir(profile)
    if not root.is_dir():
        return []
    meta = read_zoo_json(root)
    # hidden names: a build's temporary directories (io.atomic), never a finished model
    on_disk = sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and (p / "config.json").is_file())
    if meta is not None and zoo_listed_models(meta):
        # zoo.json's models first, then models trained into the zoo later (e.g. `moetool hybrid zoo-mamba`)
        listed = [m for m in zoo_listed_models(meta) if m in on_disk]
        return listed + [m for m in on_disk if m not in listed]
    return on_disk


def build_hint(profile: str) -> str:
    """The command that builds the zoo of ``profile``."""
    return "`moetool zoo build`" if profile == "default" else f"`moetool zoo build --profile {profile}`"


def split_zoo_name(name: str) -> tuple[str, str]:
    """``(profile, model)`` of a ``zoo:NAME`` reference: ``smollm2-code`` -> ``("smollm2", "code")`` for the real
    profiles, anything else -> ``("default", name)``."""
    for profile in NAMED_PROFILES:
        if name.startswith(f"{profile}-"):
            return profile, name[len(profile) + 1 :]
    return "default", name


def zoo_ref(profile: str, model: str) -> str | None:
    """The ``zoo:NAME`` reference of ``model`` in ``profile`` (None for a profile ``zoo:`` does not reach)."""
    if profile == "default":
        return f"zoo:{model}"
    return f"zoo:{profile}-{model}" if profile in NAMED_PROFILES else None


def resolve_zoo_model(name: str, profile: str = "default") -> Path:
    """Directory of zoo model ``name`` (``base`` or a domain) of ``profile``; with the default profile, a real
    profile's model by its prefixed name (``smollm2-base``, see :func:`split_zoo_name`).

    Raises:
        MoetoolError: the zoo is not built, or has no model of that name.
    """
    shown = name
    if profile == "default":
        profile, name = split_zoo_name(name)
    path = zoo_dir(profile) / name
    if name and "/" not in name and (path / "config.json").is_file():
        return path
    prefix = f"{profile}-" if profile in NAMED_PROFILES and shown != name else ""
    available = [prefix + m for m in zoo_models(profile)]
    listing = f"available: {', '.join(available)}" if available else f"the {profile!r} zoo is not built"
    raise MoetoolError(f"zoo model {shown!r} not found; run {build_hint(profile)} ({listing})")


def zoo_domain_text(domain: str, split: Literal["train", "valid"] = "valid", profile: str | None = None) -> str:
    """The ``train`` or held-out (``valid``) text of ``domain`` that a zoo was built with.

    ``domain`` is a domain (``code``) or a profile's domain (``smollm2-code``). With no profile named, the ``default``
    profile's text, or else the ``smollm2`` profile's: both split the same corpora with the same settings, so either
    is the same text (the ``tiny`` profile splits differently and is only used when named).
    """
    if split not in ("train", "valid"):
        raise MoetoolError(f"split must be 'train' or 'valid', got {split!r}")
    named, domain = split_zoo_name(domain)
    if domain not in DOMAINS:
        raise MoetoolError(f"unknown zoo domain {domain!r}; known domains: {', '.join(DOMAINS)}")
    if profile is None and named != "default":
        profile = named
    candidates = [profile] if profile is not None else ["default", *NAMED_PROFILES]
    for p in candidates:
        path = zoo_dir(p) / "data" / domain / f"{split}.txt"
        if path.is_file():
            return path.read_text(encoding="utf-8")
    first = zoo_dir(candidates[0]) / "data" / domain / f"{split}.txt"
    raise MoetoolError(f"zoo text {first} not found; run {build_hint(candidates[0])}")
