"""Checks on output and input folders, run before any expensive work: where an output may go, and whether a
folder is a finished model (not a moetool temp dir or a half-written folder)."""

from __future__ import annotations

import os
from pathlib import Path

from moetool.errors import MoetoolError, OutputPathError, SourceError
from moetool.io.atomic import leftover_owner, parent_problem


def _resolved(p: Path) -> Path:
    return Path(os.path.abspath(Path(p).expanduser())).resolve()


def check_output_path(output: Path | str, inputs: list[Path] | tuple[Path, ...] = ()) -> Path:
    """Refuse an output path that cannot be written safely, before any expensive work; returns it resolved.

    Refused (:class:`OutputPathError`, saying which): an empty path, ``.``, ``..``, the working directory or one of
    its parents, a filesystem root; a path under an existing file; a parent that cannot be written; a path equal to
    or inside any input; a parent of any input (replacing it with ``--force`` would delete the input).

    Args:
        inputs: every local directory or file the command reads (sources, base model, recipe file).
    """
    text = str(output)
    if text.strip() == "":
        raise OutputPathError("the output path is empty; pass -o DIR")
    raw = Path(text).expanduser()
    if raw.name in ("", ".", ".."):
        raise OutputPathError(f"output {text!r}: name a new directory, not {raw.name or text!r}")
    out = _resolved(raw)
    if out == out.parent:
        raise OutputPathError(f"output {text!r} is a filesystem root")
    cwd = _resolved(Path.cwd())
    if out == cwd or cwd.is_relative_to(out):
        raise OutputPathError(f"output {text!r} is the working directory or one of its parents; name a new directory")
    if leftover_owner(out) is not None:
        raise OutputPathError(f"output {text!r} is a moetool temporary directory name; choose another name")
    problem = parent_problem(out)
    if problem is not None:
        raise OutputPathError(f"output {text!r}: {problem}")
    for inp in inputs:
        i = _resolved(Path(inp))
        if out == i:
            raise OutputPathError(f"output {text!r} is an input ({inp}); it would be replaced")
        if out.is_relative_to(i):
            raise OutputPathError(f"output {text!r} is inside the input {inp}; write it elsewhere")
        if i.is_relative_to(out):
            raise OutputPathError(
                f"output {text!r} contains the input {inp}; replacing it would delete the input. Write it elsewhere"
            )
    return out


def check_report_path(
    path: Path | str, inputs: list[Path] | tuple[Path, ...] = (), *, option: str = "--output", folder: bool = False
) -> Path:
    """Refuse, before any work, a report file (``-o FILE``, ``--log``, a plots folder) that could not be written or
    would replace an input; returns it resolved. Every command that writes a report checks it here.

    Refused (:class:`OutputPathError`, naming ``option``): an existing directory unless ``folder``, and everything
    :func:`check_output_path` refuses: a path under a file or an unwritable folder, an input itself (a model's
    ``config.json`` given to ``--json``), a path inside an input folder, or one that holds an input.

    Args:
        inputs: every local file or folder the command reads.
        option: the option that named ``path``, for the message.
        folder: the report is a folder of files (plots), not one file.
    """
    if not folder and Path(path).is_dir():
        raise OutputPathError(f"{option} {path} is a directory; name the file to write")
    try:
        return check_output_path(path, inputs)
    except OutputPathError as exc:
        raise OutputPathError(f"{option}: {exc}") from None


def is_moetool_temp(path: Path) -> bool:
    """Whether ``path`` or one of its parents is a moetool temporary or displaced output (an unfinished write)."""
    p = _resolved(Path(path))
    return any(leftover_owner(Path(part)) is not None for part in (p, *p.parents))


def unfinished_reason(path: Path) -> str | None:
    """Why ``path`` is not a finished model directory, or None if it is one.

    Finished: not a moetool temporary directory; a ``config.json`` that parses as a JSON object; weights that are
    complete (every shard of an index present, every safetensors header valid and its data inside the file); if
    ``moetool.json`` is there, it parses too.
    """
    from moetool.io.checkpoint import Checkpoint
    from moetool.io.safe import read_json

    path = Path(path)
    if is_moetool_temp(path):
        return (
            "a moetool temporary directory (left by an interrupted write; it is removed by the next write of that "
            "output)"
        )
    if not path.is_dir():
        return "not a directory"
    if not (path / "config.json").is_file():
        return "no config.json (not a finished model directory)"
    try:
        ck = Checkpoint(path, allow_pickle=True)
        ck.config  # noqa: B018 - parses config.json
        if any(f.suffix == ".safetensors" for f in ck.weight_files):
            ck.tensors  # noqa: B018 - reads and checks every header against its file
        if (path / "moetool.json").is_file():
            read_json(path / "moetool.json", what="moetool metadata")
    except MoetoolError as exc:
        return f"incomplete or corrupt: {exc}"
    return None


def is_finished_model_dir(path: Path) -> bool:
    """Whether ``path`` is a finished moetool or Hugging Face model directory (see :func:`unfinished_reason`)."""
    return unfinished_reason(path) is None


def check_finished_model_dir(path: Path) -> None:
    """Refuse a model input that is a moetool temporary directory or a half-written folder.

    Raises:
        SourceError: naming the directory and what is wrong with it.
    """
    reason = unfinished_reason(path)
    if reason is not None:
        raise SourceError(f"{path}: {reason}")
