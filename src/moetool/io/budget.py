"""Memory and disk a stage needs, checked before it starts: a stage that cannot fit says so, naming the need, what is
available and the way out, instead of being killed (or filling the disk) after minutes of work.

What is available: the machine's ``MemAvailable`` (Linux) and the free space of the output's filesystem, or the
budgets set in ``MOETOOL_MEMORY_BUDGET`` / ``MOETOOL_DISK_BUDGET`` (bytes, or with a K/M/G/T suffix) when a user
wants a stage held to less (a shared machine) or a test shrinks them.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from moetool.errors import MoetoolError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MEMORY_ENV = "MOETOOL_MEMORY_BUDGET"
DISK_ENV = "MOETOOL_DISK_BUDGET"


class BudgetError(MoetoolError):
    """A stage would need more memory or disk than there is; nothing was written."""


def parse_size(text: str, *, what: str) -> int:
    """``"8G"``, ``"512M"``, ``"1073741824"`` → bytes.

    Raises:
        BudgetError: not a size.
    """
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS and not t[-1:].isdigit() else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise BudgetError(f"{what}={text!r}: not a size (e.g. 8G, 512M, or bytes)") from None
    if not math.isfinite(value):
        raise BudgetError(f"{what}={text!r}: not a size (e.g. 8G, 512M, or bytes)")
    if value < 0:
        raise BudgetError(f"{what}={text!r}: a size cannot be negative")
    return int(value * _UNITS[unit])


def available_memory() -> int | None:
    """Bytes of memory a stage may use: ``MOETOOL_MEMORY_BUDGET``, else ``MemAvailable``; None when unknown.

    Raises:
        BudgetError: the variable is set to something that is not a size.
    """
    if os.environ.get(MEMORY_ENV):
        return parse_size(os.environ[MEMORY_ENV], what=MEMORY_ENV)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_disk(path: Path) -> int:
    """Free bytes on the filesystem ``path`` will be written to (its nearest existing ancestor), or
    ``MOETOOL_DISK_BUDGET`` when set.

    Raises:
        BudgetError: the variable is set to something that is not a size.
    """
    if os.environ.get(DISK_ENV):
        return parse_size(os.environ[DISK_ENV], what=DISK_ENV)
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def human(n: float) -> str:
    """Bytes as ``1.23 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


@dataclass(frozen=True)
class Need:
    """What a stage needs before it starts: peak memory and the bytes it writes, with how each was estimated."""

    stage: str
    memory: int
    memory_detail: str
    disk: int = 0
    output: Path | None = None
    way_out: str = ""

    def check(self) -> None:
        """Refuse the stage when its memory or disk need exceeds what is available.

        Raises:
            BudgetError: naming the need (and how it was estimated), what is available, and the way out.
        """
        mem = available_memory()
        if mem is not None and self.memory > mem:
            source = MEMORY_ENV if os.environ.get(MEMORY_ENV) else "available memory"
            raise BudgetError(
                f"{self.stage} needs about {human(self.memory)} of memory ({self.memory_detail}), more than the "
                f"{human(mem)} of {source}; nothing was written. {self.way_out}".rstrip()
            )
        if self.output is not None and self.disk:
            free = free_disk(self.output)
            if self.disk > free:
                source = DISK_ENV if os.environ.get(DISK_ENV) else f"free space under {self.output.parent}"
                raise BudgetError(
                    f"{self.stage} writes about {human(self.disk)} to {self.output}, more than the {human(free)} of "
                    f"{source}; nothing was written. Free space or choose another -o"
                )
