"""Swap two paths' names in one step: Linux ``renameat2(RENAME_EXCHANGE)``, so an output replaced with ``--force``
is at every instant either the complete old or the complete new one (:mod:`moetool.io.atomic`)."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["exchange"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    """glibc's ``renameat2``, or None (another C library, or glibc < 2.28)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``, both must exist).

    Returns False where the call is not available (other systems, old C libraries, filesystems without it).
    """
    fn = _renameat2() if sys.platform.startswith("linux") else None
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))
