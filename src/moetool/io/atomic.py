"""Write an output directory atomically: build in a temporary sibling, move into place when complete."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moetool.errors import OutputExistsError


def check_output(out: Path, *, force: bool) -> None:
    """Refuse an existing, non-empty ``out`` unless ``force``.

    Raises:
        OutputExistsError: naming the path and the flag that overrides.
    """
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise OutputExistsError(f"{out} exists; pass --force to replace it")


@contextmanager
def atomic_dir(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield a temporary directory next to ``out``; on success it replaces ``out``, on any failure it vanishes.

    The temporary directory lives in ``out``'s parent so the final move is a rename on one filesystem.
    """
    out = Path(out)
    check_output(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.moetool-tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the result should look like any directory the user makes
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.moetool-old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
