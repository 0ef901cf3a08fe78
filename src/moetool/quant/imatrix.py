"""Importance matrices: per weight tensor (and per expert of a stacked one), the sum of squared input activations
per column and the tokens behind it, in llama.cpp's GGUF imatrix format.

The format (llama.cpp ``tools/imatrix``, ``general.type = imatrix``): for each weight tensor ``NAME`` of the model
GGUF, a tensor ``NAME.in_sum2`` of shape ``[n_mat, n_per_row]`` (one row per expert of a stacked tensor, 1 otherwise)
holding Σ x² over the tokens each matrix saw, and ``NAME.counts`` of shape ``[n_mat, 1]`` holding those token counts;
``imatrix.datasets``, ``imatrix.chunk_count`` and ``imatrix.chunk_size`` describe the calibration. llama.cpp's
quantizer weighs each column by ``in_sum2 / counts`` and gives a matrix that saw no token weight 1 (no importance):
moetool's collection makes sure no expert is left so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moetool.errors import MoetoolError

SUFFIX_SUMS = ".in_sum2"
SUFFIX_COUNTS = ".counts"
FILE_SUFFIX = ".imatrix.gguf"
Mode = Literal["routed", "all"]
MODES: tuple[Mode, ...] = ("routed", "all")


class ImatrixError(MoetoolError):
    """An importance matrix that cannot be read, or does not fit the model it is meant for."""


@dataclass(frozen=True)
class Calibration:
    """How to collect: the texts (domain → text), the mode and the budget.

    Attributes:
        texts: calibration text per domain (each cut to ``max_tokens // len(texts)`` tokens).
        source: where the texts came from (for the manifest).
        mode: ``routed`` or ``all`` (``moetool.export.gguf.imatrix``).
        min_tokens: in ``routed`` mode, the fewest routed tokens an expert may have before it is computed on every
            token instead.
        max_tokens: calibration tokens in all.
        seq_len: tokens per window.
    """

    texts: Mapping[str, str]
    source: str = "user"
    mode: Mode = "routed"
    min_tokens: int = 128
    max_tokens: int = 8192
    seq_len: int = 512


@dataclass
class ImportanceEntry:
    """One weight tensor's statistics.

    Attributes:
        sums: ``[n_mat, n_per_row]`` float64, Σ x² per input column for each matrix (expert).
        counts: ``[n_mat]`` float64, tokens each matrix saw.
    """

    sums: np.ndarray
    counts: np.ndarray

    @property
    def n_mat(self) -> int:
        return int(self.sums.shape[0])

    def values(self) -> np.ndarray:
        """``[n_mat * n_per_row]`` float32 importance as llama.cpp's quantizer reads it: the mean of x² per column
        (a matrix that saw nothing: 1, llama.cpp's own fallback)."""
        # float32 sums over float32 counts, as llama.cpp computes them from the file: values from memory and from
        # the saved file are then the same bits, and so are the quantized bytes
        sums = self.sums.astype(np.float32)
        counts = np.round(self.counts).astype(np.float32)
        out = np.ones_like(sums)
        seen = counts > 0
        out[seen] = sums[seen] / counts[seen, None]
        return np.ascontiguousarray(out.reshape(-1), dtype=np.float32)


@dataclass
class ImportanceMatrix:
    """Statistics per GGUF weight tensor name, with what they were collected on.

    Attributes:
        entries: GGUF tensor name → its :class:`ImportanceEntry`.
        datasets: names of the calibration texts.
        chunk_count: calibration windows run.
        chunk_size: tokens per window.
        info: moetool's own record (collection mode, the floor, tokens per domain); not read by llama.cpp.
    """

    entries: dict[str, ImportanceEntry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, sums: np.ndarray, counts: np.ndarray) -> None:
        """Accumulate ``sums`` (``[n_mat, n_per_row]``) and ``counts`` (``[n_mat]``) into tensor ``name``."""
        e = self.entries.get(name)
        if e is None:
            self.entries[name] = ImportanceEntry(sums.astype(np.float64).copy(), counts.astype(np.float64).copy())
            return
        e.sums += sums
        e.counts += counts

    def expert_tokens(self) -> dict[str, list[int]]:
        """Per stacked (expert) tensor, the tokens each expert saw."""
        return {n: [int(c) for c in e.counts] for n, e in sorted(self.entries.items()) if e.n_mat > 1}

    def starved(self, names: Iterable[str] | None = None) -> dict[str, list[int]]:
        """Stacked tensors with an expert that saw no token: name → those experts' indices."""
        wanted = set(names) if names is not None else None
        out = {}
        for n, e in self.entries.items():
            if e.n_mat > 1 and (wanted is None or n in wanted):
                idle = [i for i, c in enumerate(e.counts) if c <= 0]
                if idle:
                    out[n] = idle
        return out

    def save(self, path: Path) -> None:
        """Write ``path`` in llama.cpp's GGUF imatrix format (moetool's record under ``moetool.imatrix.info``)."""
        import json

        import gguf

        w = gguf.GGUFWriter(str(path), arch="")
        for kv in w.kv_data:  # llama.cpp's imatrix files name no architecture
            kv.pop(gguf.Keys.General.ARCHITECTURE, None)
        w.add_type(gguf.GGUFType.IMATRIX)
        w.add_array(gguf.Keys.IMatrix.DATASETS, list(self.datasets) or ["unknown"])
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(self.chunk_count))
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(self.chunk_size))
        if self.info:
            w.add_string(INFO_KEY, json.dumps(self.info, sort_keys=True))
        for name, e in sorted(self.entries.items()):
            # as llama-imatrix writes them: a single matrix's pair is 1-D (ggml drops trailing dimensions of 1)
            sums = e.sums.reshape(-1) if e.n_mat == 1 else e.sums
            counts = e.counts.reshape(-1) if e.n_mat == 1 else e.counts.reshape(-1, 1)
            w.add_tensor(name + SUFFIX_SUMS, np.ascontiguousarray(sums, dtype=np.float32))
            w.add_tensor(name + SUFFIX_COUNTS, np.ascontiguousarray(counts, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def load(path: Path) -> ImportanceMatrix:
    """Read a GGUF imatrix (llama.cpp's ``llama-imatrix -o FILE.gguf`` or moetool's).

    Raises:
        ImatrixError: not a GGUF imatrix (the legacy ``.dat`` format included: convert it with llama.cpp's
            ``llama-imatrix --in-file X.dat -o X.gguf``), a tensor without its pair, sums that do not split into one
            row per count, NaN, infinite or negative statistics, or a malformed ``moetool.imatrix.info`` record.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ImatrixError(
            f"{path}: not a GGUF imatrix ({exc}); a legacy .dat imatrix converts with llama.cpp's "
            f"`llama-imatrix --in-file FILE.dat -o FILE.gguf`"
        ) from None
    kind = _field(reader, "general.type")
    if kind != "imatrix":
        raise ImatrixError(f"{path}: general.type is {kind!r}, not 'imatrix' (is this a model GGUF?)")
    tensors = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
    datasets = _field(reader, gguf.Keys.IMatrix.DATASETS) or []
    out = ImportanceMatrix(
        datasets=[str(d) for d in datasets] if isinstance(datasets, list) else [str(datasets)],
        chunk_count=_count(path, reader, gguf.Keys.IMatrix.CHUNK_COUNT),
        chunk_size=_count(path, reader, gguf.Keys.IMatrix.CHUNK_SIZE),
        info=_info(path, _field(reader, INFO_KEY)),
    )
    for key, sums in tensors.items():
        if not key.endswith(SUFFIX_SUMS):
            continue
        name = key[: -len(SUFFIX_SUMS)]
        counts = tensors.get(name + SUFFIX_COUNTS)
        if counts is None:
            raise ImatrixError(f"{path}: {key} has no {name + SUFFIX_COUNTS}")
        # llama.cpp's layout: sums [n_mat, n_per_row] beside counts [n_mat]; any other pair cannot be split by matrix
        if counts.size == 0 or sums.size == 0 or sums.size % counts.size:
            raise ImatrixError(
                f"{path}: {key} holds {sums.size:,} sums for {counts.size:,} counts in {name + SUFFIX_COUNTS}; an "
                "importance matrix holds one row of sums per count (the file is corrupt, or not from llama-imatrix)"
            )
        for part, values in ((key, sums), (name + SUFFIX_COUNTS, counts)):
            if not np.isfinite(values).all() or (values < 0).any():
                raise ImatrixError(
                    f"{path}: {part} holds {int(np.isnan(values).sum()):,} NaN, {int(np.isinf(values).sum()):,} "
                    f"infinite and {int((values < 0).sum()):,} negative values; sums of squares and token counts "
                    "are finite and never negative (recollect it)"
                )
        out.entries[name] = ImportanceEntry(sums.reshape(counts.size, -1), counts.reshape(-1))
    if not out.entries:
        raise ImatrixError(f"{path}: the imatrix holds no tensor statistics")
    return out


INFO_KEY = "moetool.imatrix.info"


def _count(path: Path, reader: Any, key: str) -> int:
    """A non-negative integer field (0 when absent)."""
    value = _field(reader, key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ImatrixError(f"{path}: {key} is {value!r}, not a count")
    return int(value)


def _info(path: Path, value: Any) -> dict[str, Any]:
    """moetool's own record (:data:`INFO_KEY`): a JSON object, or nothing in a file llama-imatrix wrote."""
    import json

    if value is None:
        return {}
    try:
        info = json.loads(value) if isinstance(value, str) else None
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise ImatrixError(f"{path}: {INFO_KEY} is not valid JSON ({exc}); remove the field or recollect") from None
    if not isinstance(info, dict):
        raise ImatrixError(f"{path}: {INFO_KEY} must be a JSON object (moetool's collection record)")
    routed = info.get("routed_tokens")
    if routed is not None and not (
        isinstance(routed, dict)
        and all(isinstance(v, list) and all(isinstance(c, int) for c in v) for v in routed.values())
    ):
        raise ImatrixError(f"{path}: {INFO_KEY}: routed_tokens must map tensor names to lists of token counts")
    return info


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()
