"""Write tensors into size-bounded safetensors shards with a Hugging Face index."""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType

import torch
from safetensors.torch import save_file


class ShardedWriter:
    """Context manager that streams tensors into shards of at most ``max_shard_bytes``.

    Memory held: the tensors of the current shard only. Shards are named ``model-0000k-of-0000N.safetensors``
    with ``model.safetensors.index.json``, or ``model.safetensors`` when one shard suffices.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        self._names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.contiguous()
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        idx = len(self._shards)
        save_file(self._buffer, str(self.out_dir / f"shard-{idx:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer = {}
        self._buffer_bytes = 0

    def close(self) -> None:
        if self._buffer or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            (self.out_dir / "shard-00000.tmp").rename(self.out_dir / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out_dir / f"shard-{i:05d}.tmp").rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
