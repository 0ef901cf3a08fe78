"""MkDocs hooks for the documentation site (mkdocs.yml names this file under ``hooks:``).

- ``<!-- moetool-options: COMMAND -->`` in a page becomes the options table of ``moetool COMMAND`` (every
  subcommand's, for a command group), read from the Typer app itself, so the site never lists an option the command
  line does not have.
- The docs are written for GitHub as well as for the site: a list may follow its paragraph without a blank line and
  nests by two spaces. Python-Markdown needs the blank line and four spaces, so lists are adjusted before rendering
  (fenced code is left alone).
- A pipe in a table cell's code span is written ``\\|`` for GitHub; Python-Markdown needs it bare.
- Before the build, a stale docs/reference/recipe.md (see scripts/gen_recipe_reference.py) is a warning, which
  ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.plugins.moetool")

OPTIONS = re.compile(r"^<!-- moetool-options: ([\w -]+) -->$", re.M)
LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+\.)\s")
FENCE = re.compile(r"^\s*(```|~~~)")
TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$", re.M)
CODE_SPAN = re.compile(r"`[^`]+`")


def on_pre_build(config: Any) -> None:
    spec = importlib.util.spec_from_file_location("gen_recipe_reference", ROOT / "scripts" / "gen_recipe_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.PAGE.read_text(encoding="utf-8") != module.render():
        log.warning("docs/reference/recipe.md is stale: run .venv/bin/python scripts/gen_recipe_reference.py")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    markdown = OPTIONS.sub(lambda m: options_markdown(m.group(1).split()), lists_for_python_markdown(markdown))
    return code_pipes_for_python_markdown(markdown)


def code_pipes_for_python_markdown(markdown: str) -> str:
    """GitHub needs ``\\|`` for a pipe in a table cell's code span; Python-Markdown would print the backslash."""
    return TABLE_ROW.sub(lambda row: CODE_SPAN.sub(lambda m: m.group(0).replace("\\|", "|"), row.group(0)), markdown)


# ------------------------------------------------------------------------------------------------ options tables


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def _kind(p: Any, ctx: Any) -> str:
    """The value an option takes, in words (Typer shows it as ``<str>``, ``<int range>``, ``<list[str]>``…)."""
    shown = p.display_type(ctx).strip("<>")
    if getattr(p, "is_flag", False):
        return "flag"
    repeat = shown.startswith("list[") or p.nargs == -1
    base = shown.removeprefix("list[").removesuffix("]")
    kind = {"str": "text", "int": "integer", "int range": "integer", "float": "number", "float range": "number"}
    text = kind.get(base, base)
    bounds = [f"≥ {p.min}" if p.min is not None else "", f"≤ {p.max}" if p.max is not None else ""]
    bounds = [b for b in bounds if b]
    return text + (f" ({', '.join(bounds)})" if bounds else "") + (", repeatable" if repeat else "")


def _param_row(p: Any, ctx: Any) -> str:
    if p.param_type_name == "argument":
        name = f"`{p.name.upper()}`"
    else:
        name = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
    if p.required:
        default = "required"
    elif p.default is None or p.default in ([], (), ""):
        default = ""
    elif getattr(p, "is_flag", False) and not p.secondary_opts:
        default = "" if p.default is False else "on"
    elif isinstance(p.default, bool):
        default = f"`{(p.opts if p.default else p.secondary_opts)[0]}`"
    else:
        default = f"`{_cell(str(p.default))}`"
    return f"| {name} | {_kind(p, ctx)} | {default} | {_cell(p.help or '')} |"


def _table(command: Any, ctx: Any) -> list[str]:
    params = [p for p in command.params if not p.hidden]
    if not params:
        return ["No arguments or options besides `--help`."]
    rows = ["| argument or option | value | default | what it does |", "|---|---|---|---|"]
    return [*rows, *(_param_row(p, ctx) for p in params)]


def options_markdown(path: list[str]) -> str:
    """The options table of ``moetool PATH…``; for a group, a heading and a table per subcommand."""
    import typer

    from moetool.cli import app

    command: Any = typer.main.get_command(app)
    ctx = command.context_class(command)
    for name in path:
        command = command.get_command(ctx, name)
        if command is None:
            raise ValueError(f"moetool-options: no command moetool {' '.join(path)}")
        ctx = command.context_class(command, parent=ctx)
    if not hasattr(command, "list_commands"):
        return "\n".join(_table(command, ctx))
    out: list[str] = []
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        sub_ctx = sub.context_class(sub, parent=ctx)
        summary = _cell((sub.help or "").split("\n\n")[0])
        out += [f"### `{' '.join(['moetool', *path, name])}`", "", summary, "", *_table(sub, sub_ctx), ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ lists


def lists_for_python_markdown(markdown: str) -> str:
    """A blank line before a list that follows a paragraph, and two-space nesting made four-space."""
    out: list[str] = []
    fence = False
    in_list = False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fence = not fence
            out.append(line)
            continue
        if fence:
            out.append(line)
            continue
        item = LIST_ITEM.match(line)
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip():
            out.append(line)
            continue
        if item and not in_list and out and out[-1].strip():
            out.append("")
        if item:
            in_list = True
        elif indent == 0 and (not out or not out[-1].strip()):
            in_list = False
        out.append(" " * indent + line if in_list and indent else line)
    return "\n".join(out)
