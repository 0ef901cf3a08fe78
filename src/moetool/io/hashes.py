"""sha256 of weight files, remembered by what ``stat`` says of each file, so a merge of inputs already hashed does not
read and hash gigabytes again for its provenance (git's index does the same for its object ids).

An entry is used only while the file's device, inode, size, modification and change times are all as recorded: any
write moves the change time, which no program can set back. A file written within :data:`RACY_NS` of its hashing is
not remembered, because a later write inside the same coarse clock tick could leave both times where they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moetool.io.atomic import atomic_write_text
from moetool.paths import cache_dir

CACHE_FILE = "sha256.json"
RACY_NS = 2_000_000_000
HASH_THREADS = 2
MAX_ENTRIES = 4096  # the cache stays a few hundred KB whatever is merged over time
Signature = list[int]  # [st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The hex sha256 of the file at ``path``."""
    h = hashlib.sha256()
    buf = bytearray(chunk)  # one buffer for every block: a fresh bytes object per block costs page faults
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _signature(st: os.stat_result) -> Signature:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _load(cache: Path) -> dict[str, list[object]]:
    """The remembered entries; an unreadable or malformed cache is an empty one (it only saves time)."""
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        k: v
        for k, v in data.items()
        if isinstance(v, list) and len(v) == 6 and all(type(x) is int for x in v[:5]) and isinstance(v[5], str)
    }


def _save(cache: Path, entries: dict[str, list[object]]) -> None:
    """Write the entries of files that still exist, newest last, at most :data:`MAX_ENTRIES`; a cache that cannot be
    written is skipped (a read-only home must not fail a merge)."""
    kept = {k: v for k, v in entries.items() if os.path.exists(k)}
    kept = dict(list(kept.items())[-MAX_ENTRIES:])
    with contextlib.suppress(OSError):
        atomic_write_text(cache, json.dumps(kept, separators=(",", ":")))


def cached_sha256(paths: Iterable[Path], *, cache: Path | None = None) -> dict[Path, str]:
    """sha256 of each file in ``paths``, from the cache where the file is unchanged, else read and hashed.

    Args:
        cache: the cache file (default: ``sha256.json`` in moetool's cache directory, ``$MOETOOL_CACHE``).
    """
    cache = cache if cache is not None else cache_dir() / CACHE_FILE
    entries = _load(cache)
    paths = list(paths)
    out: dict[Path, str] = {}
    todo: list[tuple[Path, str, Signature]] = []
    for path in paths:
        key = os.path.realpath(path)
        sig = _signature(os.stat(key))
        entry = entries.get(key)
        if entry is not None and entry[:5] == sig:
            out[path] = str(entry[5])
        else:
            todo.append((path, key, sig))
    started = time.time_ns()
    # two files at a time: hashlib and the reads release the GIL, and one sha256 stream (~2 GB/s) leaves a core idle
    # while it waits on the disk
    with ThreadPoolExecutor(min(HASH_THREADS, max(1, len(todo)))) as pool:
        digests = list(pool.map(lambda t: sha256_file(Path(t[1])), todo))
    changed = False
    for (path, key, sig), digest in zip(todo, digests, strict=True):
        out[path] = digest
        if _signature(os.stat(key)) == sig and max(sig[3], sig[4]) < started - RACY_NS:
            entries.pop(key, None)  # re-inserted last: the newest entries survive the size bound
            entries[key] = [*sig, digest]
            changed = True
    if changed:
        _save(cache, entries)
    return {p: out[p] for p in paths}
