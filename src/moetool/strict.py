"""Shared pydantic base for every recipe section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A model that rejects unknown keys, so a typo is an error rather than a silently ignored setting."""

    model_config = ConfigDict(extra="forbid", frozen=True)
