"""Narrowing loose mappings to a TypedDict: JSON's number rules, wrong types left out, container fields refused."""

from __future__ import annotations

from typing import TypedDict

import pytest

from moetool.io.narrow import scalar_fields


class _Fields(TypedDict, total=False):
    name: str
    count: int
    rate: float
    on: bool
    tags: list[str]


def test_keeps_each_field_of_its_type_in_key_order() -> None:
    got = scalar_fields(
        _Fields, {"rate": 2, "count": 3, "name": "x", "on": False, "other": 1}, ("name", "count", "rate")
    )
    assert got == {"name": "x", "count": 3, "rate": 2.0}
    assert list(got) == ["name", "count", "rate"]
    assert isinstance(got["rate"], float)  # an int is a valid float, and becomes one


@pytest.mark.parametrize(
    ("key", "value"),
    [("count", True), ("rate", False), ("count", 2.0), ("count", "2"), ("name", 1), ("on", 1)],
)
def test_leaves_out_a_value_of_another_type(key: str, value: object) -> None:
    assert scalar_fields(_Fields, {key: value}, ("name", "count", "rate", "on")) == {}


def test_refuses_a_container_field_or_unknown_key() -> None:
    with pytest.raises(TypeError, match=r"_Fields\.tags: not a str, int, float or bool field"):
        scalar_fields(_Fields, {"tags": ["a"]})
    with pytest.raises(TypeError, match=r"_Fields\.nope"):
        scalar_fields(_Fields, {}, ("nope",))
