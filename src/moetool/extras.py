"""Optional dependencies behind one helper: a missing extra becomes one sentence naming the command that installs it.

Every import of a package that comes from a pip extra (``pyproject.toml``'s ``[project.optional-dependencies]``) goes
through :func:`require`, so a command without its extra exits with a :class:`MissingExtraError` (one red line, exit
code 2) instead of a ``ModuleNotFoundError`` traceback, and every message names the same set-up command as the README.

A leaf: it imports only the standard library and :mod:`moetool.errors`, so any layer may use it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from moetool.errors import MoetoolError

# extras whose packages live in their own venv (their pins clash with the main environment's): the command that
# makes that venv, and what to run afterwards
_OWN_VENV = {
    "tflite": "bash scripts/setup.sh --tflite (litert-torch lives in its own venv, .venv-litert; or set "
    "MOETOOL_LITERT_PYTHON to a python that has it)",
    "comigs": "bash scripts/setup.sh --comigs, then run .venv-flwr/bin/moetool (Flower lives in its own venv: it pins "
    "protobuf, typer and rich below the main environment's)",
}
# what an install costs, said up front because it is long
_NOTES = {"llama": "; it compiles llama.cpp, about 12 minutes on 2 cores"}


class MissingExtraError(MoetoolError):
    """An optional dependency is not installed; the message names the extra and the command that installs it."""

    def __init__(self, message: str, *, module: str, extra: str) -> None:
        super().__init__(message)
        self.module = module
        self.extra = extra


def install_hint(extra: str) -> str:
    """The command that installs ``extra``, as the README gives it (``bash scripts/setup.sh --<extra>``)."""
    if extra in _OWN_VENV:
        return _OWN_VENV[extra]
    return f"bash scripts/setup.sh --{extra} (or pip install 'moetool[{extra}]'{_NOTES.get(extra, '')})"


def missing(module: str, extra: str, *, why: str = "", otherwise: str = "") -> MissingExtraError:
    """The error :func:`require` raises, for a check that does not import (``importlib.util.find_spec``, a venv).

    Args:
        why: what needs it ("ONNX export", "the hybrid router's ONNX graph"); default "this command".
        otherwise: a way round it, appended after "or" ("pass --no-verify to write an unverified artifact").
    """
    tail = f"; or {otherwise}" if otherwise else ""
    return MissingExtraError(
        f"{why or 'this command'} needs {module} (the {extra} extra), which is not installed: "
        f"{install_hint(extra)}{tail}",
        module=module,
        extra=extra,
    )


def require(module: str, extra: str, *, why: str = "", otherwise: str = "") -> ModuleType:
    """Import ``module`` (from the pip extra ``extra``) and return it.

    Raises:
        MissingExtraError: it (or a package it imports) is not installed, naming ``extra``'s install command.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        # a half-installed extra fails on a sub-dependency: name that one too, the fix is the same
        name = exc.name
        partial = name is not None and name != module and not module.startswith(f"{name}.")
        shown = f"{module} ({name} is missing)" if partial else module
        error = missing(shown, extra, why=why, otherwise=otherwise)
        error.module = module
        raise error from None
