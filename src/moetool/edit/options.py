"""Checks of the options an expert edit takes, run before any work: a dtype or device the stages refuse or would
never read, text given where nothing reads it."""

from __future__ import annotations

from pathlib import Path

from moetool.edit.layout import EditError

__all__ = ["check_precision", "check_unread_data"]


def check_precision(model: Path, dtype: str | None, device: str | None, *, runs: bool = True, why: str = "") -> None:
    """Refuse, before any work, a ``dtype`` or ``device`` that train and eval refuse, or one nothing would read.

    The values go through the same checks as train's and eval's (:func:`moetool.compute.dtypes.resolve_dtype`
    and ``resolve_device``); where ``runs`` is False the edit runs no model, and ``why`` says so.

    Raises:
        MoetoolError: an unknown dtype or device, or CUDA where there is none (naming the option and its values).
        EditError: a dtype or device given where ``runs`` is False.
    """
    from moetool.compute.dtypes import resolve_device, resolve_dtype

    for option, value in (("--dtype", dtype), ("--device", device)):
        if value in (None, "auto"):
            continue
        if option == "--dtype":
            resolve_dtype(value, model)
        else:
            resolve_device(value)
        if not runs:
            raise EditError(f"{option} {value}: {why}; leave it out")


def check_unread_data(data: dict[str, str] | None, steps: int) -> None:
    """Refuse ``--data`` for an edit whose only reader of text is router recalibration, when there is none.

    Raises:
        EditError: naming ``--tune-steps``.
    """
    if data and not steps:
        raise EditError(
            "--data: this edit reads text only to recalibrate the routers; give --tune-steps N, or leave --data out"
        )
