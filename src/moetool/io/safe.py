"""One input-safety layer: every JSON and YAML file a user hands moetool is read through here.

Each reader bounds the size it reads, requires UTF-8 (naming the byte offset of the first bad byte), refuses duplicate
keys, bounds nesting (and, for YAML, aliases and their expansion), and turns every parse failure into a
:class:`~moetool.errors.MoetoolError` subclass that names the file and, where known, the line and key. Nothing here
raises ``JSONDecodeError``, ``UnicodeDecodeError``, ``RecursionError`` or ``MemoryError`` on any input.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from moetool.errors import CheckpointError, InputFileError, MoetoolError
from moetool.io.jsontypes import JsonObject, JsonValue

MAX_JSON_BYTES = 512 * 1024 * 1024  # a tokenizer.json of a 250k vocabulary is ~30 MB; this only stops the absurd
MAX_YAML_DEPTH = 64  # recipes nest < 8 deep; pure-Python YAML composing recurses 3 frames a level
MAX_YAML_ALIASES = 256  # *alias events in one document
MAX_YAML_NODES = 100_000  # nodes of the document with every alias expanded (billion laughs: 10**9)

Loc = tuple[str | int, ...]


def _fail(error: type[MoetoolError], message: str) -> MoetoolError:
    return error(message)


def read_bytes(
    path: Path, *, what: str = "file", max_bytes: int = MAX_JSON_BYTES, error: type[MoetoolError] = InputFileError
) -> bytes:
    """Read ``path`` whole, refusing a missing file, a directory or one larger than ``max_bytes`` (before reading).

    Memory follows the file's own size, never ``max_bytes``: ``read(n)`` allocates its ``n``-byte buffer up front,
    so asking for the maximum (4 GiB for text) fails under an address-space limit (``ulimit -v``, containers) even
    for a 100 KB file.

    Raises:
        error: naming the file and ``what`` it should have been.
    """
    path = Path(path)
    if "\0" in str(path):  # open() would raise ValueError: no file name holds a NUL byte
        raise _fail(error, f"{str(path)!r}: a file name cannot contain a NUL byte")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise _fail(error, f"{path}: {what} is {size:,} bytes, more than the {max_bytes:,} allowed")
            data = _read_bounded(f, size, max_bytes)
    except IsADirectoryError:
        raise _fail(error, f"{path}: {what} is a directory, not a file") from None
    except MemoryError:  # a pipe or device file streaming more than this process may hold
        raise _fail(error, f"{path}: {what} does not fit in this process's memory") from None
    except OSError as exc:
        raise _fail(error, f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:  # grew while being read, or a device file
        raise _fail(error, f"{path}: {what} is more than the {max_bytes:,} bytes allowed")
    return data


_CHUNK = 1 << 20  # what a file that grew after its stat, a pipe or a /proc file is read by


def _read_bounded(f: BinaryIO, size: int, max_bytes: int) -> bytes:
    """At most ``max_bytes + 1`` bytes of ``f``: its stat ``size`` plus one byte in one read (the one extra byte
    shows a file that grew, or one whose stat size is 0: a pipe, /proc), then the rest in bounded chunks."""
    data = f.read(size + 1)
    if len(data) <= size:
        return data
    parts, total = [data], len(data)
    while total <= max_bytes:
        chunk = f.read(min(_CHUNK, max_bytes + 1 - total))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


MAX_TEXT_BYTES = 4 * 1024**3  # a domain corpus read whole; beyond this the user wants a dataset, not a file


def read_text(
    path: Path, *, what: str = "text file", max_bytes: int = MAX_TEXT_BYTES, error: type[MoetoolError] = InputFileError
) -> str:
    """A UTF-8 text file, whole: :func:`read_bytes` then :func:`decode_utf8`.

    Raises:
        error: a missing file, a directory, one over ``max_bytes``, or bytes that are not UTF-8 (with the line and
            byte offset of the first bad byte).
    """
    return decode_utf8(
        read_bytes(path, what=what, max_bytes=max_bytes, error=error), Path(path), what=what, error=error
    )


def decode_utf8(data: bytes, path: Path, *, what: str = "file", error: type[MoetoolError] = InputFileError) -> str:
    """``data`` as text; a UTF-8 byte-order mark is dropped.

    Raises:
        error: the bytes are not UTF-8, naming the file, the line and the byte offset of the first bad byte.
    """
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise _fail(
            error,
            f"{path}:{line}: {what} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r}); "
            "save it as UTF-8",
        ) from None


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, JsonValue]]) -> JsonObject:
    out: JsonObject = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def parse_json(
    data: bytes | str,
    path: Path,
    *,
    what: str = "JSON file",
    error: type[MoetoolError] = InputFileError,
    expect: type | None = dict,
) -> Any:
    """Parse JSON ``data`` read from ``path``: UTF-8, no duplicate keys, bounded nesting, of type ``expect``.

    Raises:
        error: naming the file (with line and column of a syntax error) and ``what`` it is.
    """
    text = decode_utf8(data, path, what=what, error=error) if isinstance(data, bytes) else data
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise _fail(error, f"{path}:{exc.lineno}:{exc.colno}: {what} is not valid JSON: {exc.msg}") from None
    except _DuplicateKey as exc:
        raise _fail(error, f"{path}: {what} has the key {exc.key!r} twice") from None
    except RecursionError:  # the C decoder guards its recursion; arrays or objects nested ~1000 deep
        raise _fail(error, f"{path}: {what} nests too deeply to be a real {what}") from None
    except ValueError as exc:  # e.g. an integer longer than sys.get_int_max_str_digits()
        raise _fail(error, f"{path}: {what} cannot be parsed: {exc}") from None
    if expect is not None and not isinstance(value, expect):
        want = "object" if expect is dict else "array" if expect is list else expect.__name__
        raise _fail(error, f"{path}: {what} must be a JSON {want}, not {type(value).__name__}")
    return value


def read_json(
    path: Path,
    *,
    what: str = "JSON file",
    error: type[MoetoolError] = CheckpointError,
    expect: type | None = dict,
    max_bytes: int = MAX_JSON_BYTES,
) -> Any:
    """Read a JSON file of a model directory (``config.json``, an index, ``tokenizer.json``, a manifest).

    Args:
        what: what the file is, for messages ("model config", "safetensors index").
        error: the MoetoolError subclass raised (a checkpoint's files: :class:`CheckpointError`).
        expect: the type the top-level value must have (None: any).

    Raises:
        error: missing, unreadable, too large, not UTF-8, malformed, duplicate keys, too deep, or not ``expect``.
    """
    return parse_json(
        read_bytes(path, what=what, error=error, max_bytes=max_bytes), Path(path), what=what, error=error, expect=expect
    )


# ---------------------------------------------------------------------------------------------------------------------
# YAML


class YamlRefused(Exception):
    """Raised while composing: the document breaks a budget (``mark`` is where)."""

    def __init__(self, message: str, mark: yaml.Mark | None) -> None:
        super().__init__(message)
        self.mark = mark


class BudgetLoader(yaml.SafeLoader):
    """A SafeLoader that counts nesting and aliases while composing, before any object is constructed.

    It also reads YAML 1.2 floats without a dot (``1e-3``), which YAML 1.1 would leave as strings.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise YamlRefused(
                    f"more than {MAX_YAML_ALIASES} aliases (*name); a recipe needs few", self.peek_event().start_mark
                )
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise YamlRefused(f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


BudgetLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

_MERGE = "tag:yaml.org,2002:merge"


def _walk(node: yaml.Node, loader: BudgetLoader, path: Path, error: type[MoetoolError]) -> dict[Loc, int]:
    """Field path → 1-based line for the composed tree; refuses an alias expansion past the node budget and
    duplicate keys in one mapping (before any object is constructed)."""
    # expanded size of every node, memoised on identity: the DAG of a billion-laughs document is small, its tree is not
    sizes: dict[int, int] = {}
    order: list[yaml.Node] = []
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        if id(n) in sizes:
            continue
        if done:
            kids = _children(n)
            sizes[id(n)] = 1 + sum(sizes[id(k)] for k in kids)
            order.append(n)
            if sizes[id(n)] > MAX_YAML_NODES:
                raise _fail(
                    error,
                    f"{path}:{n.start_mark.line + 1}: more than {MAX_YAML_NODES:,} values once aliases are expanded "
                    "(an alias bomb?)",
                )
            continue
        stack.append((n, True))
        stack.extend((k, False) for k in _children(n) if id(k) not in sizes)

    lines: dict[Loc, int] = {}
    todo: list[tuple[yaml.Node, Loc]] = [(node, ())]
    while todo:
        n, loc = todo.pop()
        lines.setdefault(loc, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            seen: dict[object, yaml.Node] = {}
            for key, value in n.value:
                if key.tag == _MERGE:
                    merged = value.value if isinstance(value, yaml.SequenceNode) else [value]
                    todo.extend((m, loc) for m in merged)
                    continue
                k = _key(key, loader)
                sub = (*loc, str(key.value))
                if k in seen:
                    first = seen[k].start_mark.line + 1
                    raise _fail(
                        error,
                        f"{path}:{key.start_mark.line + 1}: {_format_loc(sub)}: duplicate key {k!r} (first at line "
                        f"{first}); the second would silently win",
                    )
                if k is not None:
                    seen[k] = key
                lines.setdefault(sub, key.start_mark.line + 1)
                todo.append((value, sub))
        elif isinstance(n, yaml.SequenceNode):
            todo.extend((item, (*loc, i)) for i, item in enumerate(n.value))
    return lines


def _children(n: yaml.Node) -> list[yaml.Node]:
    if isinstance(n, yaml.MappingNode):
        return [x for kv in n.value for x in kv]
    if isinstance(n, yaml.SequenceNode):
        return list(n.value)
    return []


def _key(key: yaml.Node, loader: BudgetLoader) -> object:
    """A mapping key's value, for duplicate detection (None for a key that is not a plain scalar)."""
    if not isinstance(key, yaml.ScalarNode):
        return None
    try:
        k = loader.construct_object(key, deep=True)
    except Exception:  # a malformed scalar: construction reports it later with its own message
        return None
    try:
        hash(k)
    except TypeError:
        return None
    return k


def _format_loc(loc: Loc) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse_yaml(
    data: bytes | str, path: Path, *, what: str = "YAML file", error: type[MoetoolError] = InputFileError
) -> tuple[Any, dict[Loc, int]]:
    """Parse one YAML document under budgets: ``(value, lines)`` where ``lines`` maps field paths to 1-based lines.

    Refused, naming the file and line: not UTF-8, syntax errors, nesting deeper than :data:`MAX_YAML_DEPTH`, more
    than :data:`MAX_YAML_ALIASES` aliases or an expansion past :data:`MAX_YAML_NODES`, duplicate keys in a mapping,
    more than one document, and values YAML cannot construct (``2001-02-30``, unknown ``!!tags``).
    """
    text = decode_utf8(data, path, what=what, error=error) if isinstance(data, bytes) else data
    try:
        loader = BudgetLoader(text)
    except yaml.reader.ReaderError as exc:  # a control character anywhere in the text
        line = text.count("\n", 0, max(exc.position, 0)) + 1
        raise _fail(error, f"{path}:{line}: not valid YAML: character {exc.character:#06x} is not allowed") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {(): 1}
        lines = _walk(node, loader, path, error)
        value = loader.construct_document(node)
    except YamlRefused as exc:
        where = f"{path}:{exc.mark.line + 1}" if exc.mark is not None else str(path)
        raise _fail(error, f"{where}: {exc}") from None
    except MoetoolError:  # _walk's own refusals (duplicate keys, alias expansion) already name file and line
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or exc
        raise _fail(error, f"{where}: not valid YAML: {problem}") from None
    except Exception as exc:  # constructing plain data: ValueError (2001-02-30), IndexError (`!!int ""`), …
        raise _fail(error, f"{path}: {what}: a value YAML cannot read: {type(exc).__name__}: {exc}") from None
    finally:
        loader.dispose()
    return value, lines


def read_yaml(
    path: Path,
    *,
    what: str = "YAML file",
    error: type[MoetoolError] = InputFileError,
    max_bytes: int = 1024 * 1024,
) -> Any:
    """Read and parse a YAML file under :func:`parse_yaml`'s budgets (size bounded by ``max_bytes``)."""
    value, _ = parse_yaml(
        read_bytes(path, what=what, error=error, max_bytes=max_bytes), Path(path), what=what, error=error
    )
    return value
