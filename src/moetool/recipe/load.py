"""Load a recipe file: YAML → the pydantic model of its ``method``, with file, field and line in every error."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from moetool import registry
from moetool.errors import RecipeError
from moetool.io.safe import Loc, decode_utf8, parse_yaml, read_bytes
from moetool.recipe.base import RecipeBase


def recipe_models() -> dict[str, type[RecipeBase]]:
    """The recipe model of every registered method (:data:`moetool.registry.METHODS`), by method name."""
    return {name: registry.load(entry.recipe) for name, entry in registry.METHODS.items()}


@cache
def recipe_adapter() -> TypeAdapter[RecipeBase]:
    """One validator for every recipe: the discriminated union (on ``method``) of the registered recipe models."""
    union = Union[tuple(recipe_models().values())]  # type: ignore[valid-type]  # noqa: UP007
    return TypeAdapter(Annotated[union, Field(discriminator="method")])  # type: ignore[arg-type]


def recipe_json_schema() -> dict[str, Any]:
    """JSON schema of every recipe kind, one entry per method under ``oneOf``."""
    defs: dict[str, Any] = {}
    refs = []
    for model in recipe_models().values():
        schema = model.model_json_schema(ref_template="#/$defs/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            # one namespace for every method's section models: two different models of one class name would
            # silently replace each other
            if name in defs and defs[name] != sub:
                raise RuntimeError(f"recipe schema: two different section models are named {name!r}; rename one")
            defs[name] = sub
        defs[model.__name__] = schema
        refs.append({"$ref": f"#/$defs/{model.__name__}"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "moetool recipe",
        "oneOf": refs,
        "$defs": defs,
    }


def _format_loc(loc: Loc) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


_TYPE_ERRORS = {"int_type", "float_type", "bool_type", "string_type", "list_type", "dict_type", "model_type"}
_YAML_TYPE = {
    str: "the string",
    bool: "the boolean",
    int: "the integer",
    float: "the number",
    type(None): "null",
    list: "the list",
    dict: "the mapping",
}

_LOC_IN_MESSAGE = re.compile(r"^([A-Za-z_][\w]*(?:\.[\w]+)*): ")


def _errors(exc: ValidationError, path: Path, lines: dict[Loc, int], tag: str | None = None) -> list[str]:
    out = []
    for err in exc.errors():
        loc: Loc = tuple(err["loc"])
        if tag is not None and loc[:1] == (tag,):
            loc = loc[1:]
        msg = err["msg"]
        if err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
            # cross-field validators put the precise field, relative to their own model, at the start of their
            # message; a nested model's validator error already carries the path down to that model
            m = _LOC_IN_MESSAGE.match(msg)
            if m:
                loc = loc + tuple(int(p) if p.isdigit() else p for p in m.group(1).split("."))
                msg = msg[m.end() :]
        elif err["type"] == "extra_forbidden":
            msg = "unknown key (not allowed here; check the spelling)"
        elif err["type"] in _TYPE_ERRORS:
            # strict models never coerce: say what was given, since YAML quoting or `yes` made it so
            got = err.get("input")
            msg = f"{msg}, not {_YAML_TYPE.get(type(got), type(got).__name__)} {_short(got)}"
            if isinstance(got, str) and err["type"] in ("int_type", "float_type", "bool_type"):
                msg += " (remove the quotes)"
        probe = loc
        while probe not in lines and probe:
            probe = probe[:-1]
        where = f"{path}:{lines[probe]}" if probe in lines else str(path)
        out.append(f"{where}: {_format_loc(loc)}: {msg}")
    return out


def _short(value: object, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


MAX_RECIPE_BYTES = 1024 * 1024  # recipes are a few KB; prompts lists included, far below this


def parse_recipe(text: str | bytes, path: Path) -> RecipeBase:
    """Validate recipe ``text`` (or raw bytes, which must be UTF-8) read from ``path``.

    The YAML is read under :func:`moetool.io.safe.parse_yaml`'s budgets: no duplicate keys, bounded nesting, aliases
    and size; values are never coerced across types (``experts_per_token: "2"`` is an error).

    Raises:
        RecipeError: naming the file, field path and line of every problem.
    """
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path}: recipe is {size:,} bytes, more than the {MAX_RECIPE_BYTES:,} allowed")
    if isinstance(text, bytes):
        text = decode_utf8(text, path, what="recipe", error=RecipeError)
    data, lines = parse_yaml(text, path, what="recipe", error=RecipeError)
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping with at least 'name' and 'method'")
    method = data.get("method")
    if not isinstance(method, str) or method not in registry.METHODS:
        where = f"{path}:{lines.get(('method',), 1)}"
        hint = registry.did_you_mean(str(method), registry.METHODS)
        raise RecipeError(f"{where}: method: {_short(method)} is not a known method ({hint})")
    try:
        recipe = recipe_adapter().validate_python(data)
    except ValidationError as exc:
        # the union puts the method's tag first in every location; the file's own field paths come after it
        raise RecipeError("invalid recipe:\n  " + "\n  ".join(_errors(exc, path, lines, tag=method))) from None
    return recipe.with_origin(path, text)


def load_recipe(path: str | Path) -> RecipeBase:
    """Read and validate a recipe file (at most :data:`MAX_RECIPE_BYTES`, UTF-8).

    Raises:
        RecipeError: the file is missing, too large, not UTF-8, not YAML, or invalid (file, field path and line named).
    """
    p = Path(path)
    return parse_recipe(read_bytes(p, what="recipe", error=RecipeError, max_bytes=MAX_RECIPE_BYTES), p)


def dump_schema() -> str:
    return json.dumps(recipe_json_schema(), indent=2)
