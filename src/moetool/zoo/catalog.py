"""What is built, per profile: ``moetool zoo list``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moetool.paths import cache_dir, zoo_dir
from moetool.zoo.config import all_profiles
from moetool.zoo.store import zoo_models, zoo_ref


@dataclass(frozen=True)
class ZooEntry:
    """One built zoo model: its profile, name in the profile, ``zoo:`` reference (None if unreachable), folder and
    size on disk in bytes."""

    profile: str
    model: str
    ref: str | None
    path: Path
    size: int


def dir_size(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def built_profiles() -> list[str]:
    """The known profiles first, then any other profile folder found in the zoo cache."""
    known = all_profiles()
    root = cache_dir() / "zoo"
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    return known + [p for p in found if p not in known]


def zoo_catalog() -> dict[str, list[ZooEntry]]:
    """Every profile and the models built in it (an empty list: not built)."""
    return {
        profile: [
            ZooEntry(profile, m, zoo_ref(profile, m), zoo_dir(profile) / m, dir_size(zoo_dir(profile) / m))
            for m in zoo_models(profile)
        ]
        for profile in built_profiles()
    }
