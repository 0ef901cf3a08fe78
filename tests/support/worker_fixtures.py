"""Stand-ins for a worker's interpreter: :func:`moetool.export.worker.run_worker` runs ``PYTHON -m MODULE REQUEST``,
so an executable script given as ``python`` is the whole worker, started exactly as a real one is."""

from __future__ import annotations

import os
from pathlib import Path


def fake_python(path: Path, body: str) -> str:
    """An executable ``/bin/sh`` script at ``path`` running ``body``; its path, for ``run_worker(python=...)``."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def exists(pid: int) -> bool:
    """Whether process ``pid`` is still there (a reaped worker is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
