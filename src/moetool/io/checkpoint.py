"""Read a Hugging Face checkpoint directory lazily: config, tensor headers, one shard open at a time."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from moetool.errors import SourceError

# safetensors dtype tag -> (torch dtype, bytes per element)
SAFETENSORS_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry: where it lives and what it is, without its data."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0  # absolute byte offset of the data in ``file``

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * SAFETENSORS_DTYPES[self.dtype][1]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors file's JSON header only (no tensor data is read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {
        k: TensorInfo(k, path, v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0]) for k, v in header.items()
    }


class Checkpoint:
    """A checkpoint directory read tensor by tensor; at most one shard is open at a time.

    Tensors are read with plain seeks and reads rather than a memory map, so resident memory holds only the tensor
    being converted: mapped pages of every input file would otherwise accumulate in RSS over a merge.

    Args:
        path: directory with config.json and ``*.safetensors`` (sharded with an index, or single).
        allow_pickle: also accept ``pytorch_model*.bin`` (loaded with ``torch.load(weights_only=True)``).
    """

    def __init__(self, path: Path, *, allow_pickle: bool = False) -> None:
        self.path = Path(path)
        self.allow_pickle = allow_pickle
        self._open_file: Path | None = None
        self._handle: Any = None
        self._pickled: dict[str, torch.Tensor] | None = None

    @cached_property
    def config(self) -> dict[str, Any]:
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise SourceError(f"{self.path}: no config.json (not a Hugging Face model directory)")
        return dict(json.loads(cfg.read_text()))

    @cached_property
    def weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [self.path / n for n in names]
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        pickles = sorted(self.path.glob("pytorch_model*.bin"))
        if pickles and not self.allow_pickle:
            raise SourceError(
                f"{self.path}: only pickle weights (pytorch_model*.bin); pickle can run code on load. Convert to "
                "safetensors, or pass --allow-pickle if you trust the file"
            )
        if pickles:
            return pickles
        raise SourceError(f"{self.path}: no *.safetensors weights found")

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor's header, keyed by name."""
        out: dict[str, TensorInfo] = {}
        for f in self.weight_files:
            if f.suffix == ".bin":
                for k, t in self._load_pickles().items():
                    dt = {v[0]: k2 for k2, v in SAFETENSORS_DTYPES.items()}[t.dtype]
                    out[k] = TensorInfo(k, f, dt, tuple(t.shape))
                continue
            out.update(read_safetensors_header(f))
        return out

    def _load_pickles(self) -> dict[str, torch.Tensor]:
        if self._pickled is None:
            self._pickled = {}
            for f in self.weight_files:
                self._pickled.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        return self._pickled

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (a copy, detached from the file).

        Raises:
            SourceError: the tensor does not exist, naming the checkpoint.
        """
        info = self.tensors.get(name)
        if info is None:
            raise SourceError(f"{self.path}: missing tensor {name!r}")
        if info.file.suffix == ".bin":
            return self._load_pickles()[name].clone()
        if self._open_file != info.file:
            self.close()
            self._handle = open(info.file, "rb")  # noqa: SIM115 - kept open across calls, closed by close()
            self._open_file = info.file
        self._handle.seek(info.offset)
        buf = bytearray(info.nbytes)
        if self._handle.readinto(buf) != info.nbytes:
            raise SourceError(f"{info.file}: truncated data for tensor {name!r}")
        if not buf:
            return torch.empty(info.shape, dtype=SAFETENSORS_DTYPES[info.dtype][0])
        return torch.frombuffer(buf, dtype=SAFETENSORS_DTYPES[info.dtype][0]).reshape(info.shape)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle = None
        self._open_file = None

    @property
    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.weight_files)
