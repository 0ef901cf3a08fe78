"""Numbers read from a parsed JSON document (``config.json`` above all), narrowed from :data:`JsonValue`.

``float``/``int`` read a numeric string as well as a number, as the exporters always have; anything else (an array,
an object, null) is an :class:`~moetool.export.base.ExportError` naming the key and the file.
"""

from __future__ import annotations

from moetool.export.base import ExportError
from moetool.io.jsontypes import JsonValue


def _numeric(value: JsonValue, key: str, where: str, want: str) -> str | int | float:
    """``value`` where it is a number or numeric string (bools are ints here, as ``float(True)`` reads them).

    Raises:
        ExportError: it is neither, naming ``key``, ``where`` and the ``want``-ed kind.
    """
    if isinstance(value, str | int | float):
        return value
    raise ExportError(f"{where}: {key} is {value!r}, not {want}")


def number(value: JsonValue, key: str, where: str = "config.json") -> float:
    """``float(value)`` for a number or numeric string (else an :class:`ExportError` naming ``key`` and ``where``)."""
    return float(_numeric(value, key, where, "a number"))


def integer(value: JsonValue, key: str, where: str = "config.json") -> int:
    """``int(value)`` for a number or numeric string (else an :class:`ExportError` naming ``key`` and ``where``)."""
    return int(_numeric(value, key, where, "an integer"))
