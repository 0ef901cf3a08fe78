"""The CLI's leaf: the two consoles, error formatting, verbosity. Imports nothing of moetool's above it, so the
commands and the methods' sub-apps (``moetool.methods.*.cli``) share it without a cycle."""

from __future__ import annotations

import errno
import logging
import math
import os
import warnings
from collections.abc import Callable
from functools import wraps
from typing import NoReturn, ParamSpec, TextIO, TypeVar

import typer
from rich.markup import escape

from moetool.errors import MoetoolDeprecationWarning, MoetoolError
from moetool.progress import cli_console

console = cli_console(stderr=True)  # progress, stage rules, warnings
out = cli_console(stderr=False)  # results: tables, "wrote …", labelled figures

P = ParamSpec("P")
R = TypeVar("R")


def fail(message: str) -> NoReturn:
    """End the command with one red ``error:`` line (never wrapped) and exit code 2: a user error, no traceback."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def friendly(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn user errors into one red message and exit code 2 (no traceback)."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except MoetoolError as exc:
            fail(str(exc))
        except Exception as exc:
            if not _disk_full(exc):
                raise
            fail(
                f"the disk filled up while writing ({exc}); the unfinished output was removed and nothing else "
                "changed. Free space or write to another filesystem (-o)"
            )

    return wrapper


def _disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT, as an OSError or as the text of a library's own error (safetensors' SafetensorError)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc)


N = TypeVar("N", int, float)


def _numbers(option: str, text: str, parse: Callable[[str], N], what: str) -> list[tuple[str, N]]:
    """Each non-empty comma-separated item of ``text`` with its value (``parse``: ``int`` or ``float``).

    Raises:
        MoetoolError: an item ``parse`` refuses, naming the option and ``what`` the list holds.
    """
    values = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            values.append((item, parse(item)))
        except ValueError:
            raise MoetoolError(f"{option}: {text!r} is not a comma-separated list of {what}") from None
    return values


def float_list(option: str, text: str, *, positive: bool = False) -> list[float]:
    """``"1e-3,3e-3"`` → finite numbers (above 0 with ``positive``): a comma-separated option's values.

    Raises:
        MoetoolError: a value that is not a number, ``nan``/``inf`` (``float()`` takes both), or not above 0.
    """
    values = _numbers(option, text, float, "numbers")
    for item, value in values:
        if not math.isfinite(value) or (positive and value <= 0):
            raise MoetoolError(f"{option}: {item!r} is not a finite number{' above 0' if positive else ''}")
    if not values:
        raise MoetoolError(f"{option}: give at least one number")
    return [value for _, value in values]


def int_list(option: str, text: str, *, minimum: int = 1, distinct: int = 1) -> list[int]:
    """``"16,32,64"`` → integers of at least ``minimum``, at least ``distinct`` different ones.

    Raises:
        MoetoolError: a value that is not an integer or below ``minimum``, or too few different values.
    """
    values = [value for _, value in _numbers(option, text, int, "integers")]
    for value in values:
        if value < minimum:
            raise MoetoolError(f"{option}: {value} is below {minimum}")
    if len(set(values)) < max(1, distinct):
        raise MoetoolError(f"{option}: {text!r}: give at least {distinct} different values")
    return values


def human(n: float) -> str:
    """Bytes for people: ``1.2 MB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def figure(label: str, value: str) -> None:
    """One labelled result line (``label: value``), the shape every command prints its checks and figures in."""
    out.print(f"{label}: {value}", highlight=False)


def set_verbosity(verbose: bool) -> None:
    """Without ``--verbose``: no third-party progress bars ("Loading weights"), INFO logs or warnings meant for
    GPUs; moetool's own warnings still print. Set before transformers and onnxruntime are imported."""
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("ORT_LOGGING_LEVEL", "3")
    # torch resets its registered loggers' levels when it is imported; "-onnx" keeps the exporter's at ERROR
    # ("torchvision is not installed. Skipping torchvision::nms" ×4 per graph otherwise)
    os.environ.setdefault("TORCH_LOGS", "-onnx")
    logging.getLogger().setLevel(logging.WARNING)
    for name in (
        "onnxruntime",
        "onnxscript",
        "torch",
        "torch.onnx",
        "torch._dynamo",
        "torch.utils._pytree",  # torchao's enum registration warns on every start (torch's own handler)
        "coremltools",
        "accelerate",
        "torchao",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in ("torch", "transformers", "onnxscript", "onnxruntime", "coremltools", "torchao", "accelerate"):
        warnings.filterwarnings("ignore", module=module)
    # raised from copyreg while torch.export pickles its tree specs: no module of torch's to match
    warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec", category=FutureWarning)


def show_deprecations() -> None:
    """Print each of moetool's deprecation warnings (an old spelling read) as one ``deprecated:`` line on stderr;
    every other warning is shown as Python shows it."""
    shown = warnings.showwarning
    if getattr(shown, "moetool", False):
        return

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if issubclass(category, MoetoolDeprecationWarning):
            console.print(f"[yellow]deprecated:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
        else:
            shown(message, category, filename, lineno, file, line)

    show.moetool = True  # type: ignore[attr-defined]
    warnings.showwarning = show
