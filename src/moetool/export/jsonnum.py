"""Numbers read from a parsed JSON document (``config.json`` above all), narrowed from :data:`JsonValue`.

``float``/``int`` read a numeric string as well as a number, as the exporters always have; anything else (an array,
an object, null) is an :class:`~moetool.export.base.ExportError` naming the key and the file.
"""

from __future__ import annotations

from moetool.export.base import ExportError
from moetool.io.jsontypes import JsonValue


def number(value: JsonValue, key: str, where: str = "config.json") -> float:
    """``float(value)`` for a number or numeric string.

    Raises:
        ExportError: ``value`` is neither, naming ``key`` and ``where``.
    """
    if isinstance(value, str | int | float):
        return float(value)
    raise ExportError(f"{where}: {key} is {value!r}, not a number")


def integer(value: JsonValue, key: str, where: str = "config.json") -> int:
    """``int(value)`` for a number or numeric string.

    Raises:
        ExportError: ``value`` is neither, naming ``key`` and ``where``.
    """
    if isinstance(value, str | int | float):
        return int(value)
    raise ExportError(f"{where}: {key} is {value!r}, not an integer")
