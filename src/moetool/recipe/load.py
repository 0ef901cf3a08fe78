"""Load a recipe file: YAML → the pydantic model of its ``method``, with file, field and line in every error."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import Field, TypeAdapter, ValidationError

from moetool import registry
from moetool.errors import RecipeError
from moetool.recipe.base import RecipeBase

Loc = tuple[str | int, ...]


def recipe_models() -> dict[str, type[RecipeBase]]:
    """The recipe model of every registered method (:data:`moetool.registry.METHODS`), by method name."""
    return {name: registry.load(entry.recipe) for name, entry in registry.METHODS.items()}


@cache
def recipe_adapter() -> TypeAdapter[RecipeBase]:
    """One validator for every recipe: the discriminated union (on ``method``) of the registered recipe models."""
    union = Union[tuple(recipe_models().values())]  # type: ignore[valid-type]  # noqa: UP007
    return TypeAdapter(Annotated[union, Field(discriminator="method")])


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


def _line_map(node: yaml.Node, loc: Loc = ()) -> dict[Loc, int]:
    """Map every field path in a composed YAML tree to its 1-based line."""
    lines: dict[Loc, int] = {loc: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            sub = (*loc, str(key.value))
            lines[sub] = key.start_mark.line + 1
            for k, v in _line_map(value, sub).items():
                lines.setdefault(k, v)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.update(_line_map(item, (*loc, i)))
    return lines


def _format_loc(loc: Loc) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


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
        probe = loc
        while probe not in lines and probe:
            probe = probe[:-1]
        where = f"{path}:{lines[probe]}" if probe in lines else str(path)
        out.append(f"{where}: {_format_loc(loc)}: {msg}")
    return out


def parse_recipe(text: str, path: Path) -> RecipeBase:
    """Validate recipe ``text`` read from ``path``.

    Raises:
        RecipeError: naming the file, field path and line of every problem.
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise RecipeError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict) or node is None:
        raise RecipeError(f"{path}: a recipe must be a YAML mapping with at least 'name' and 'method'")
    lines = _line_map(node)
    method = data.get("method")
    if method not in registry.METHODS:
        where = f"{path}:{lines.get(('method',), 1)}"
        hint = registry.did_you_mean(method, registry.METHODS)
        raise RecipeError(f"{where}: method: {method!r} is not a known method ({hint})")
    try:
        recipe = recipe_adapter().validate_python(data)
    except ValidationError as exc:
        # the union puts the method's tag first in every location; the file's own field paths come after it
        raise RecipeError("invalid recipe:\n  " + "\n  ".join(_errors(exc, path, lines, tag=method))) from None
    return recipe.with_origin(path, text)


def load_recipe(path: str | Path) -> RecipeBase:
    """Read and validate a recipe file.

    Raises:
        RecipeError: the file is missing, not YAML, or invalid (file, field path and line named).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"{p}: cannot read recipe: {exc.strerror}") from None
    return parse_recipe(text, p)


def dump_schema() -> str:
    return json.dumps(recipe_json_schema(), indent=2)
