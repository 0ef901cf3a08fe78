"""Where moetool keeps its caches."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The moetool cache root: ``$MOETOOL_CACHE`` or ``$XDG_CACHE_HOME/moetool`` (``~/.cache/moetool``)."""
    env = os.environ.get("MOETOOL_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "moetool"


def zoo_dir(profile: str = "default") -> Path:
    """Directory of the expert zoo built for ``profile``."""
    return cache_dir() / "zoo" / profile
