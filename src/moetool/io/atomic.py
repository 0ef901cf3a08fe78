"""Write an output directory atomically: build in a temporary sibling, move into place when complete.

Crash safety:

* the temporary sibling is ``.NAME.moetool-tmp-PID-XXXX`` (PID: the writing process); every atomic write first
  sweeps the leftovers of writers of the same output whose process is gone (:func:`sweep_leftovers`);
* SIGTERM is handled like SIGINT while a write is in progress: the temporary directory is removed before exiting;
* ``--force`` replaces an existing output with one ``renameat2(RENAME_EXCHANGE)`` on Linux, so OUT is at every
  instant either the complete old or the complete new output. Where the exchange is not available the old output is
  first renamed to ``.NAME.moetool-old-PID-XXXX``; a run killed between the two renames leaves OUT absent, and the
  next run's sweep puts the old output back.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Set
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TypeAlias

from moetool.errors import OutputExistsError, OutputPathError
from moetool.io.exchange import exchange

TMP_MARK = ".moetool-tmp-"
OLD_MARK = ".moetool-old-"
# .NAME.moetool-tmp-PID-RANDOM, .NAME.moetool-old-PID-RANDOM (and .NAME.moetool-old-PID of moetool before 0.2)
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.moetool-(?:(?P<kind>tmp)-(?P<pid>\d+)-[^/]+|old-(?P<oldpid>\d+)(?:-[^/]*)?)$")


_HandlerFunction: TypeAlias = Callable[[int, FrameType | None], object]
# a signal's handler as signal.getsignal returns it: a function, SIG_DFL or SIG_IGN, or None (not set from Python)
_Handler: TypeAlias = _HandlerFunction | int | signal.Handlers | None


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) arrived during an atomic write; raised like SIGINT's KeyboardInterrupt so that every
    ``finally`` runs and the temporary directory is removed."""


# ---------------------------------------------------------------------------------------------------------------------
# leftovers of killed writers


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (on this machine; a pid reused by another process counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    except OSError:
        return False
    return True


def leftover_owner(path: Path) -> tuple[str, str, int] | None:
    """``(output name, "tmp" | "old", owner pid)`` if ``path``'s name is a moetool temporary or displaced output."""
    m = _LEFTOVER.match(Path(path).name)
    if m is None:
        return None
    return (m["name"], "tmp", int(m["pid"])) if m["kind"] else (m["name"], "old", int(m["oldpid"]))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sweep_leftovers(out: Path) -> list[Path]:
    """Clean up after writers of ``out`` that were killed: their processes are gone, their leftovers are not.

    * ``.NAME.moetool-old-PID-*`` (the previous output, displaced by a ``--force`` swap that did not finish): put
      back as ``out`` if ``out`` is absent (the swap was killed between its two renames), else removed;
    * ``.NAME.moetool-tmp-PID-*`` (an unfinished output, or an old one after the exchange): removed.

    Leftovers of a live process are never touched. Returns the paths removed or restored.
    """
    out = Path(out)
    parent = out.parent
    try:
        entries = list(parent.iterdir())
    except OSError:  # no parent yet, or not readable: nothing to sweep (the write itself reports it)
        return []
    done: list[Path] = []
    mine = [(p, leftover_owner(p)) for p in entries]
    dead = [(p, o) for p, o in mine if o is not None and o[0] == out.name and not pid_alive(o[2])]
    for p, (_, kind, _) in sorted(dead, key=lambda po: po[0].name):
        if kind != "old":
            continue
        try:
            if not out.exists() and not out.is_symlink():
                os.rename(p, out)  # the complete old output: the killed run never reported success
            else:
                _remove(p)
        except OSError:  # another run swept it first
            continue
        done.append(p)
    for p, (_, kind, _) in dead:
        if kind == "tmp":
            _remove(p)
            done.append(p)
    return done


# ---------------------------------------------------------------------------------------------------------------------
# checks before any work


def parent_problem(out: Path) -> str | None:
    """Why ``out`` cannot be created: the nearest existing ancestor must be a directory this process can write."""
    anc = out.parent
    while not anc.exists() and anc != anc.parent:
        if anc.is_symlink():
            return f"{anc} is a broken symbolic link"
        anc = anc.parent
    if not anc.is_dir():
        return f"{anc} is a file, not a directory"
    if not os.access(anc, os.W_OK | os.X_OK):
        return f"cannot write in {anc} (permission denied)"
    return None


def occupied(out: Path) -> bool:
    """``out`` exists and is not an empty folder: what a write refuses to replace without ``--force``."""
    return out.exists() and (not out.is_dir() or any(out.iterdir()))


def check_output(out: Path, *, force: bool) -> None:
    """Refuse an existing, non-empty ``out`` unless ``force`` (after sweeping killed writers' leftovers of ``out``).

    Raises:
        OutputExistsError: naming the path and the flag that overrides.
    """
    out = Path(out)
    sweep_leftovers(out)
    if occupied(out) and not force:
        raise OutputExistsError(f"{out} exists; pass --force to replace it")


# ---------------------------------------------------------------------------------------------------------------------
# signals and the swap


class _Handlers:
    """SIGTERM/SIGHUP handlers installed while at least one atomic write is in progress (main thread only)."""

    signals = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None)

    def __init__(self) -> None:
        self.depth = 0
        self.lock = threading.Lock()
        self.saved: dict[int, _Handler] = {}

    @staticmethod
    def _on_terminate(signum: int, frame: FrameType | None) -> None:
        raise Terminated(f"terminated by {signal.Signals(signum).name}")

    def install(self) -> None:
        with self.lock:
            self.depth += 1
            if self.depth > 1 or threading.current_thread() is not threading.main_thread():
                return
            for s in self.signals:
                with contextlib.suppress(ValueError, OSError):
                    prev = signal.getsignal(s)
                    if prev == signal.SIG_IGN:  # e.g. under nohup: keep ignoring
                        continue
                    self.saved[s] = prev
                    signal.signal(s, self._on_terminate)

    def restore(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth > 0 or threading.current_thread() is not threading.main_thread():
                return
            for s, prev in self.saved.items():
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            self.saved.clear()


_handlers = _Handlers()
_HANDLED = _Handlers.signals


@contextmanager
def _signals_blocked() -> Iterator[None]:
    """Defer SIGINT/SIGTERM/SIGHUP across a few statements, so a signal never lands between them.

    The thread's signal mask alone is not enough: the kernel hands a process-directed signal to any thread that does
    not block it (torch's and the hashing thread's), and Python then runs the handler in the main thread anyway. So
    the main thread's Python-level handlers are swapped for one that only records the signal, and each recorded
    signal is handed to the handler it displaced once the block ends.
    """
    sigs = (signal.SIGINT, *_HANDLED)
    pending: list[int] = []
    displaced: dict[int, _HandlerFunction] = {}
    active = [True]

    def record(signum: int, frame: FrameType | None) -> None:
        if active[0]:
            pending.append(signum)
        else:  # arrived while the handlers were being put back: behave as the handler it displaced
            displaced[signum](signum, frame)

    mask: Set[int] | None = None
    try:  # from the first handler swapped: a signal that interrupts the swapping must not strand a recorder
        if threading.current_thread() is threading.main_thread():  # handlers never run in other threads
            for s in sigs:
                with contextlib.suppress(ValueError, OSError):
                    prev = signal.getsignal(s)
                    if callable(prev):  # SIG_DFL ends the process as asked, SIG_IGN ignores: both stay
                        displaced[s] = prev
                        signal.signal(s, record)
        if hasattr(signal, "pthread_sigmask"):
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(sigs))
        yield
    finally:
        try:
            active[0] = False  # from here a signal raises at once, through ``record``, as it would have unblocked
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for signum in pending[:1]:  # the first one decides how the run ends, as without the block
                displaced[signum](signum, None)
        finally:
            for s, prev in displaced.items():
                signal.signal(s, prev)


def _swap_in(tmp: Path, out: Path) -> Path | None:
    """Move the finished ``tmp`` to ``out``; returns what is left to delete (the old output), if anything.

    Call with signals blocked.
    """
    if not out.exists() and not out.is_symlink():
        os.rename(tmp, out)
        return None
    if exchange(tmp, out):
        return tmp  # now holds the old output
    old = out.with_name(f".{out.name}{OLD_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    return old


def tmp_prefix(out: Path) -> str:
    """The name prefix of this process's temporary directories for ``out``."""
    return f".{Path(out).name}{TMP_MARK}{os.getpid()}-"


@contextmanager
def scratch_dir(out: Path, label: str) -> Iterator[Path]:
    """A temporary working directory beside ``out`` (an intermediate model a stage builds on its way to ``out``),
    removed on exit; named as this process's temporary of ``out``, so a killed run's is swept like any other.

    SIGTERM and SIGHUP are handled as :func:`atomic_dir` handles them for as long as it exists: the work done in it
    between atomic writes (an edit's router recalibration, a LoRA bake) ends like Ctrl-C, and the folder is removed.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _handlers.install()
    tmp: Path | None = None
    try:
        with _signals_blocked():  # as in atomic_dir: the folder is ours to remove from the moment it exists
            tmp = Path(tempfile.mkdtemp(prefix=f"{tmp_prefix(out)}{label}-", dir=out.parent))
        yield tmp
    finally:
        try:
            if tmp is not None:
                _remove(tmp)
        finally:
            _handlers.restore()


@contextmanager
def atomic_dir(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield a temporary directory next to ``out``; on success it replaces ``out``, on any failure it vanishes.

    The temporary directory lives in ``out``'s parent so the final move is a rename on one filesystem. Killed
    writers' leftovers of ``out`` are swept first; SIGTERM during the write removes the temporary directory like
    Ctrl-C does; an existing ``out`` (with ``force``) is replaced atomically where the OS allows (see the module
    docstring).
    """
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise OutputPathError(f"output {str(out)!r}: name a new directory")
    problem = parent_problem(Path(os.path.abspath(out)))
    if problem is not None:
        raise OutputPathError(f"output {out}: {problem}")
    check_output(out, force=force)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"output {out}: cannot create {out.parent}: {exc.strerror or exc}") from None
    _handlers.install()
    garbage: Path | None = None
    try:
        # a signal that lands between mkdtemp's mkdir and this assignment would leave the directory unowned
        with _signals_blocked():
            try:
                tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(out), dir=out.parent))
            except OSError as exc:
                raise OutputPathError(f"output {out}: cannot write in {out.parent}: {exc.strerror or exc}") from None
            garbage = tmp
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the result should look like any directory the user makes
        yield tmp
        with _signals_blocked():
            garbage = _swap_in(tmp, out)
    finally:
        try:
            if garbage is not None:
                _remove(garbage)
        finally:
            _handlers.restore()


__all__ = [
    "Terminated",
    "atomic_dir",
    "atomic_write_file",
    "atomic_write_text",
    "check_output",
    "exchange",
    "occupied",
    "parent_problem",
    "pid_alive",
    "scratch_dir",
    "sweep_leftovers",
    "tmp_prefix",
]


def atomic_write_file(path: Path, write: Callable[[Path], object]) -> Path:
    """Write one file so that a reader sees either the old file (or nothing) or all of the new one.

    ``write(tmp)`` fills a temporary sibling; it is fsynced, renamed over ``path``, and the directory fsynced so the
    rename itself survives a crash. On any error the temporary file is removed. Returns ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        with _signals_blocked():  # as in atomic_dir: the file is ours to remove from the moment it exists
            fd, name = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}{os.getpid()}-", dir=path.parent)
            os.close(fd)
            tmp = Path(name)
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_file` of a UTF-8 text."""
    atomic_write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
