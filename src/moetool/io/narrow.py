"""Narrowing parsed JSON (or any mapping of loose values) to a ``TypedDict`` field by field, by the field types.

JSON's own rules, as a recipe's :class:`~moetool.strict.StrictModel` applies them: ``true`` is not a number (a
bool is refused where an int or float is declared), an int is a valid float (and becomes one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar, get_type_hints

TD = TypeVar("TD", bound=Mapping[str, object])

_SCALARS = (str, int, float, bool)


def _narrowed(value: object, kind: type) -> object | None:
    """``value`` as ``kind`` (one of :data:`_SCALARS`), or None where it has another type."""
    if isinstance(value, bool) and kind is not bool:
        return None
    if kind is float and isinstance(value, int):
        return float(value)
    return value if isinstance(value, kind) else None


def scalar_fields(td: type[TD], data: Mapping[str, object], keys: Iterable[str] | None = None) -> TD:
    """The entries of ``data`` under ``keys`` (default: every field of ``td``, a ``TypedDict`` of optional fields)
    whose value has the field's type, in ``keys`` order; a key that ``data`` lacks or gives another type is left
    out, for the caller to refuse or ignore.

    Raises:
        TypeError: a key is not a field of ``td``, or its declared type is not str, int, float or bool (a
            programming error: a container field needs its own check).
    """
    hints = get_type_hints(td)
    out: dict[str, object] = {}
    for key in hints if keys is None else keys:
        kind = hints.get(key)
        if kind not in _SCALARS:
            raise TypeError(f"{td.__name__}.{key}: not a str, int, float or bool field")
        if key in data and (value := _narrowed(data[key], kind)) is not None:
            out[key] = value
    return td(**out)
