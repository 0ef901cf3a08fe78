"""Run llama.cpp's own ``convert_hf_to_gguf.py`` on a Hugging Face folder (what users do with moetool's output).

    .venv/bin/python scripts/llama_converter.py MODEL_DIR [--outfile F.gguf] [--outtype f32] [--pre NAME]

The converter is taken from the llama-cpp-python sdist of the installed version (so it matches the llama.cpp that
loads its file): ``pip download`` once into ``<moetool cache>/llama-converter/<version>``, keeping only
``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/gguf``. It runs in a subprocess with the vendored gguf-py
first on PYTHONPATH. ``--pre`` names the BPE pre-tokenizer for a tokenizer llama.cpp's hash table does not know
(tiny test tokenizers); every tensor and every other key still comes from the converter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from moetool.paths import cache_dir

DIST = "llama-cpp-python"
# what the converter imports, relative to the sdist's vendor/llama.cpp
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
_VENDOR = "vendor/llama.cpp/"
# runs the converter's __main__ with, optionally, a fixed pre-tokenizer name instead of its hash lookup
_SHIM = """
import runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
if pre:
    from conversion.base import TextModel
    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class ConverterError(RuntimeError):
    """llama.cpp's converter could not be fetched or failed on a folder."""


def installed_version() -> str:
    """The installed llama-cpp-python version (the converter must match the llama.cpp that loads its files)."""
    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError as e:
        raise ConverterError(f"{DIST} is not installed: bash scripts/setup.sh --llama") from e


def converter_dir(version: str | None = None, cache: Path | None = None) -> Path:
    """The folder holding ``convert_hf_to_gguf.py`` for ``version`` (default: installed), fetched on first use.

    Raises:
        ConverterError: PyPI unreachable, or the sdist lacks the converter.
    """
    version = version or installed_version()
    dest = (cache or cache_dir() / "llama-converter") / version
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:  # same filesystem: rename works
        sdist = _download(version, Path(tmp))
        staging = Path(tmp) / "extract"
        _extract(sdist, staging)
        try:
            staging.rename(dest)  # atomic: a half-extracted converter is never seen
        except OSError:
            if not (dest / "convert_hf_to_gguf.py").is_file():  # not a concurrent fetch that won
                raise
    return dest


def _download(version: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"{DIST}=={version}", "--no-deps", "--no-binary", ":all:"]
    proc = subprocess.run([*cmd, "-d", str(into), "-q"], capture_output=True, text=True, check=False)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ConverterError(
            f"could not download the {DIST}=={version} sdist from PyPI (it holds llama.cpp's "
            f"convert_hf_to_gguf.py): {' | '.join(tail) or 'no sdist written'}. Check the network or a pip index "
            f"setting, or place the converter in {cache_dir() / 'llama-converter' / version} by hand"
        )
    return found[0]


def _extract(sdist: Path, dest: Path) -> None:
    """Extract only the converter's files from ``sdist`` into ``dest``."""
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            _, _, rel = m.name.partition("/" + _VENDOR)
            if rel and m.isfile() and any(rel == k or rel.startswith(k) for k in _KEEP):
                m.name = rel
                members.append(m)
        if not any(m.name == "convert_hf_to_gguf.py" for m in members):
            raise ConverterError(f"{sdist.name} has no {_VENDOR}convert_hf_to_gguf.py")
        tar.extractall(dest, members=members, filter="data")


def convert(
    model_dir: Path,
    outfile: Path,
    *,
    outtype: str = "f32",
    pre: str | None = None,
    converter: Path | None = None,
) -> Path:
    """Convert ``model_dir`` with llama.cpp's converter into ``outfile``; returns ``outfile``.

    Raises:
        ConverterError: the converter failed (its last lines of output are in the message).
    """
    root = converter or converter_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "gguf-py"), str(root)]))
    env.pop("NO_LOCAL_GGUF", None)
    args = [str(model_dir), "--outfile", str(outfile), "--outtype", outtype]
    proc = subprocess.run(
        [sys.executable, "-c", _SHIM, str(root), pre or "", *args], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0 or not outfile.is_file():
        tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-8:])
        raise ConverterError(f"llama.cpp's convert_hf_to_gguf.py failed on {model_dir}:\n{tail}")
    return outfile


def _unit_trimmed(shape: Any) -> tuple[int, ...]:
    dims = [int(d) for d in shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def tensor_differences(ours: Path, theirs: Path) -> list[str]:
    """Where two GGUF files differ, tensor by tensor (empty when every tensor matches): names, types, shapes and
    bytes. Trailing unit dimensions are ignored: the converter keeps ``ffn_gate_inp_shexp`` as ne ``[H, 1]`` where
    moetool writes ``[H]``, which llama.cpp reads as the same tensor."""
    import gguf
    import numpy as np

    a = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    out = [f"{n}: only in {ours.name}" for n in sorted(set(a) - set(b))]
    out += [f"{n}: only in {theirs.name}" for n in sorted(set(b) - set(a))]
    for n in sorted(set(a) & set(b)):
        x, y = a[n], b[n]
        if x.tensor_type != y.tensor_type:
            out.append(f"{n}: type {x.tensor_type.name} vs {y.tensor_type.name}")
        elif _unit_trimmed(x.shape) != _unit_trimmed(y.shape):
            out.append(f"{n}: shape {list(map(int, x.shape))} vs {list(map(int, y.shape))}")
        elif np.asarray(x.data).tobytes() != np.asarray(y.data).tobytes():
            out.append(f"{n}: values differ")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--outfile", type=Path, help="default: MODEL_DIR/<name>-<outtype>.gguf")
    ap.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--pre", help="BPE pre-tokenizer name, for tokenizers llama.cpp's hash table does not know")
    ap.add_argument("--fetch-only", action="store_true", help="fetch the converter and print its folder")
    a = ap.parse_args(argv)
    try:
        if a.fetch_only:
            print(converter_dir())
            return 0
        out = a.outfile or a.model_dir / f"{a.model_dir.name}-{a.outtype}.gguf"
        print(convert(a.model_dir, out, outtype=a.outtype, pre=a.pre))
    except ConverterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
