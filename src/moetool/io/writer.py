"""Stream tensors into size-bounded safetensors shards whose layout is known before any data is written."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import torch

from moetool.io.checkpoint import SAFETENSORS_DTYPES

_TAG = {dt: tag for tag, (dt, _) in SAFETENSORS_DTYPES.items()}

Entry = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return SAFETENSORS_DTYPES[_TAG[dtype]][1] * math.prod(shape)


class ShardedWriter:
    """Write tensors, in a fixed order, straight to disk: memory holds one tensor, whatever the shard size.

    Because every name, dtype and shape is known from the plan, each shard's header is written first and tensor bytes
    follow as they arrive. Shards are ``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``, or
    ``model.safetensors`` when one shard suffices.

    Args:
        out_dir: an existing directory.
        entries: every tensor to be written, in write order.
        max_shard_bytes: a shard is closed before it would exceed this (a larger single tensor gets its own shard).
    """

    def __init__(self, out_dir: Path, entries: Sequence[Entry], max_shard_bytes: int) -> None:
        self.out_dir = Path(out_dir)
        self._entries = list(entries)
        names = [e[0] for e in self._entries]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in writer layout")
        shards: list[list[Entry]] = [[]]
        size = 0
        for e in self._entries:
            nb = _nbytes(e[1], e[2])
            if shards[-1] and size + nb > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += nb
        self._shards = shards
        n = len(shards)
        self.files = (
            ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.total_bytes = sum(_nbytes(e[1], e[2]) for e in self._entries)
        self._pos = 0  # index into _entries of the next tensor
        self._shard = -1
        self._fh: IO[bytes] | None = None

    def _open_next_shard(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._shard += 1
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in self._shards[self._shard]:
            nb = _nbytes(dtype, shape)
            header[name] = {"dtype": _TAG[dtype], "shape": list(shape), "data_offsets": [offset, offset + nb]}
            offset += nb
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._fh = open(self.out_dir / self.files[self._shard], "wb")  # noqa: SIM115 - closed in close()
        self._fh.write(struct.pack("<Q", len(raw)) + raw)
        self._left_in_shard = len(self._shards[self._shard])

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor; it must be the next entry of the layout, with its dtype and shape."""
        if self._pos >= len(self._entries):
            raise ValueError(f"tensor {name!r} is not in the writer layout (all entries written)")
        want = self._entries[self._pos]
        if (name, tensor.dtype, tuple(tensor.shape)) != want:
            raise ValueError(
                f"expected {want[0]} {want[1]} {list(want[2])}, got {name} {tensor.dtype} {list(tensor.shape)}"
            )
        if self._fh is None or self._left_in_shard == 0:
            self._open_next_shard()
        assert self._fh is not None
        if tensor.numel():
            # the tensor's own memory goes to the file (a bytes copy of it would cost a pass over every byte)
            self._fh.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
        self._left_in_shard -= 1
        self._pos += 1

    def close(self) -> None:
        if self._pos != len(self._entries):
            missing = self._entries[self._pos][0]
            raise ValueError(f"writer closed with {len(self._entries) - self._pos} tensors unwritten (next: {missing})")
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if len(self.files) > 1:
            weight_map = {e[0]: self.files[i] for i, shard in enumerate(self._shards) for e in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        elif self._fh is not None:
            self._fh.close()
