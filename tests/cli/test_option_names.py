"""One meaning per option name across every command (moetool.cli.options): the walk, and the old spellings."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from moetool.cli import app
from moetool.cli.options import MEANINGS, RENAMED, Meaning, old_spelling
from moetool.errors import MoetoolDeprecationWarning


def _commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """``(command path, command)`` for every command, sub-apps included."""
    for name, sub in getattr(group, "commands", {}).items():
        if hasattr(sub, "commands"):
            yield from _commands(sub, (*path, name))
        else:
            yield " ".join((*path, name)), sub


COMMANDS = dict(_commands(get_command(app)))
# an alias (`moetool gem export`) runs another command's function: its options are that command's
_FIRST = {}
for _path, _cmd in COMMANDS.items():
    _FIRST.setdefault(inspect.unwrap(_cmd.callback), _path)
ALIASES = {
    p: _FIRST[inspect.unwrap(c.callback)] for p, c in COMMANDS.items() if _FIRST[inspect.unwrap(c.callback)] != p
}


def _options() -> Iterator[tuple[str, str, Any]]:
    """``(command path, option name, click option)`` for every option of every command (an alias as itself)."""
    for path, cmd in COMMANDS.items():
        for p in cmd.params:
            if p.param_type_name == "option":
                for opt in p.opts:
                    yield path, opt, p


def _kind(p: Any) -> str:
    return "flag" if p.is_flag else "values" if p.multiple else "value"


OPTIONS = list(_options())


def test_the_walk_sees_every_command():
    commands = {c for c, _, _ in OPTIONS}
    assert {"export", "merge", "eval", "profile", "experts add", "gem eval", "hybrid pareto"} <= commands
    # every command the app registers (top level, and each group's), and every option of each
    registered = {c.name or c.callback.__name__ for c in app.registered_commands}
    groups = {g.name: g.typer_instance for g in app.registered_groups}
    registered |= {f"{n} {c.name or c.callback.__name__}" for n, t in groups.items() for c in t.registered_commands}
    assert registered == set(COMMANDS)
    for path, cmd in COMMANDS.items():
        options = [p for p in cmd.params if p.param_type_name == "option"]
        assert sum(1 for c, _, p in OPTIONS if c == path) == sum(len(p.opts) for p in options), path


def test_one_meaning_has_one_name():
    """Two option names with one meaning (--limit and --task-limit, --no-check and --no-verify were) are one name
    and an old spelling (RENAMED) of it."""
    names: dict[str, list[str]] = {}
    for name, meaning in MEANINGS.items():
        names.setdefault(meaning.what, []).append(name)
    assert {what: n for what, n in names.items() if len(n) > 1} == {}
    assert {name for _, name, p in OPTIONS if not p.hidden} <= set(MEANINGS)


def test_an_option_on_no_command_is_no_row():
    """A row of MEANINGS names an option some command has: a renamed option's row goes with it."""
    assert set(MEANINGS) <= {name for _, name, p in OPTIONS if not p.hidden}


@pytest.mark.parametrize(("command", "name", "param"), OPTIONS, ids=[f"{c}:{n}" for c, n, _ in OPTIONS])
def test_every_option_carries_its_names_one_meaning(command, name, param):
    if param.hidden and (ALIASES.get(command, command), name) in RENAMED:  # an old spelling: checked below
        return
    meaning: Meaning | None = MEANINGS.get(name)
    assert meaning is not None, (
        f"moetool {command} {name}: not in moetool.cli.options.MEANINGS; add a row with its one meaning, or use the "
        "name an existing row gives that meaning"
    )
    assert _kind(param) in meaning.kinds, (
        f"moetool {command} {name} is a {_kind(param)}, but {name} is a {'/'.join(meaning.kinds)} everywhere "
        f"({meaning.what})"
    )
    assert meaning.values in (param.help or ""), (
        f"moetool {command} {name}: its help does not name {name}'s value set {meaning.values!r} ({meaning.what}); "
        "an option of another meaning needs another name"
    )


def _given_values():
    """``(command, name, args)``: every option that takes a value, and every command's first argument, given ""."""
    for path, cmd in COMMANDS.items():
        words = path.split()
        arguments = [p for p in cmd.params if p.param_type_name == "argument"]
        if arguments:
            yield path, (arguments[0].name or "").upper(), [*words, ""]
        for p in cmd.params:
            if p.param_type_name == "option" and not p.is_flag:
                yield path, max(p.opts, key=len), [*words, p.opts[0], ""]


GIVEN = list(_given_values())


@pytest.mark.parametrize(("command", "name", "args"), GIVEN, ids=[f"{c}:{n}" for c, n, _ in GIVEN])
def test_an_empty_value_is_refused_by_name_on_every_command(command, name, args):
    """``--device ""`` (an unset shell variable) ran as the default; every option and argument now refuses it."""
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert f"{name} is empty" in r.output


def test_old_spellings_are_hidden_and_name_a_declared_option():
    seen = {(c, n): p for c, n, p in OPTIONS}
    # a flag's --no-NAME spelling names the option of --NAME's row
    declared = {(c, off): p.opts[0] for c, _, p in OPTIONS for off in p.secondary_opts}
    for (command, old), new in RENAMED.items():
        assert (command, old) in seen and seen[command, old].hidden, f"moetool {command} {old}: not a hidden option"
        named = declared.get((command, new), new)
        assert (command, named) in seen and named in MEANINGS, f"moetool {command}: {new} is not one of its options"


def test_device_is_the_torch_device_and_for_the_deployment_profile():
    device = {c for c, n, p in OPTIONS if n == "--device" and not p.hidden}
    assert {"merge", "train", "eval", "experts list"} <= device and "export" not in device
    assert {ALIASES.get(c, c) for c, n, _ in OPTIONS if n == "--for"} == {"export", "profile"}


def test_the_method_export_commands_are_aliases_of_export():
    assert {"gem export", "hybrid export", "embedding export"} <= set(ALIASES)
    assert {ALIASES[c] for c in ("gem export", "hybrid export", "embedding export")} == {"export"}


def test_a_new_meaning_under_an_old_name_is_caught():
    """The check itself: --device with a profile's help, as `moetool export` had it, fails the value-set rule."""
    meaning = MEANINGS["--device"]
    old_help = "Device profile (`moetool devices`): picks format and the best plan that fits."
    assert meaning.values not in old_help


def test_export_reads_the_old_device_spelling_with_one_deprecation_line(tiny_models, tmp_path):
    base = tiny_models("llama")["base"]
    args = ["export", str(base), "-o", str(tmp_path / "o"), "--quant", "q8_0", "--dry-run"]
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the CLI prints moetool's deprecations itself, one line each
        r = CliRunner().invoke(app, [*args, "--device", "raspberry-pi-4"])
    assert r.exit_code == 0, r.output
    assert "budget on raspberry-pi-4" in r.output
    line = "deprecated: `moetool export --device raspberry-pi-4` is the old spelling: write `--for raspberry-pi-4`"
    assert line in r.output
    r = CliRunner().invoke(app, [*args, "--device", "raspberry-pi-4", "--for", "laptop"])
    assert r.exit_code == 2 and "--device is the old spelling of --for, which is also given" in r.output
    assert not (tmp_path / "o").exists()


def test_old_spelling_warns_outside_the_cli():
    with pytest.warns(MoetoolDeprecationWarning, match=r"write `--for pixel-6`"):
        assert old_spelling("export", "--device", "pixel-6", None) == "pixel-6"
    assert old_spelling("export", "--device", None, "pixel-6") == "pixel-6"
