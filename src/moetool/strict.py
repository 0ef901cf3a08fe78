"""Shared pydantic base for every recipe section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A model that rejects unknown keys and never coerces a value across types.

    ``extra="forbid"``: a typo is an error rather than a silently ignored setting. ``strict=True``: an int field
    refuses ``"2"`` and ``true`` (YAML writes both easily, lax pydantic reads them as 2 and 1), a bool refuses
    ``"yes"`` given as a string, a str refuses a number. An int is still a valid float. Recipe YAML only yields
    str, int, float, bool, None, lists and mappings, which is all recipe fields take; a field whose type YAML cannot
    produce directly (a ``Path``, a ``tuple``, an ``Enum``) must opt back in with ``Field(strict=False)``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
