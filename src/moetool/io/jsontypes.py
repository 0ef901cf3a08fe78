"""The types of parsed JSON (and YAML read as JSON) documents: one recursive alias for every layer.

A value read with :func:`moetool.io.safe.read_json` or ``json.loads`` is a :data:`JsonValue`; narrow it with
``isinstance`` before use. Functions that only read a document take ``Mapping[str, JsonValue]`` (a ``dict`` of a
narrower value type, such as ``dict[str, int]``, is one too: ``Mapping`` is covariant in its values, ``dict`` is not).
"""

from __future__ import annotations

from typing import TypeAlias

JsonValue: TypeAlias = "str | int | float | bool | list[JsonValue] | dict[str, JsonValue] | None"
"""Any JSON value: a scalar, an array of JSON values or an object mapping strings to JSON values."""

JsonObject: TypeAlias = "dict[str, JsonValue]"
"""A JSON object (``config.json``, an index, a manifest)."""
