"""How stages report: one small interface, a rich :class:`~rich.console.Console`.

- The Python API is silent by default (:func:`silent`, a quiet console).
- The CLI passes :func:`cli_console`: rich bars and rules on a terminal; when output is not a terminal (CI logs,
  pipes) nothing is hard-wrapped, rules are one short line and long loops print a plain line every few percent.
- Long loops go through :func:`task`, so every stage shows its progress the same way; long single calls (a graph
  conversion) announce each step as it starts through :func:`step_printer`.

Stages print their checks and figures as labelled lines (``label: figures``) with ``console.print``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.text import Text


class PlainConsole(Console):
    """A console for logs and pipes: no hard wrap (wide tables stay whole rows), rules as one short line."""

    def rule(self, title: str | Text = "", *args: object, **kwargs: object) -> None:
        self.print(f"== {title} ==" if title else "==", highlight=False)


def silent() -> Console:
    """The API's default: prints nothing."""
    return Console(quiet=True)


def cli_console(*, stderr: bool = True) -> Console:
    """The CLI's console: rich on a terminal, plain and unwrapped otherwise."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    # width: wide enough that no table row or message is split; tables still take only the width they need
    return PlainConsole(stderr=stderr, soft_wrap=True, width=10_000, no_color=True)


def _eta(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


@contextmanager
def task(
    console: Console, label: str, total: int, *, unit: str = "", every: float = 0.05
) -> Iterator[Callable[..., None]]:
    """Report a loop of ``total`` steps; yields ``advance(n=1, note="")``.

    On a terminal a transient bar; otherwise a line whenever another ``every`` of the work is done, with the rate
    (``unit``/s, default steps/s) and an ETA; nothing on a quiet console.
    """
    if console.quiet:
        yield lambda n=1, note="": None
        return
    if console.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        bar = Progress(
            TextColumn(label),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} {task.fields[note]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        with bar:
            tid = bar.add_task(label, total=total, note="")
            yield lambda n=1, note="": bar.update(tid, advance=n, note=note)
        return
    start = time.monotonic()
    state = {"done": 0, "next": every}

    def advance(n: int = 1, note: str = "") -> None:
        state["done"] += n
        frac = state["done"] / max(total, 1)
        if frac + 1e-9 < state["next"] and state["done"] < total:
            return
        while state["next"] <= frac:
            state["next"] += every
        elapsed = max(time.monotonic() - start, 1e-9)
        rate = state["done"] / elapsed
        eta = (total - state["done"]) / rate if rate > 0 else 0.0
        extra = f" {note}" if note else ""
        console.print(
            f"{label}: {state['done']}/{total} ({100 * frac:.0f}%), {rate:.1f} {unit or 'steps'}/s, ETA {_eta(eta)}{extra}",
            highlight=False,
        )

    yield advance


Step = Callable[[str], None]


def step_printer(console: Console | None, started: float) -> Step:
    """A line per step as it starts, with the seconds since ``started`` (``time.perf_counter``).

    For work that is a few long calls rather than a loop: a graph conversion of a 30-layer model (ExecuTorch's
    XNNPACK lowering of the SmolLM2 MoE takes about 20 minutes on 2 cores) looks hung without these lines.
    """

    def step(what: str) -> None:
        if console is not None:
            console.print(f"{time.perf_counter() - started:7.1f} s  {what}", highlight=False)

    return step
