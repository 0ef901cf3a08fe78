"""The plan a merge method produces: every output tensor and where it comes from, before any weight is read."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from moetool.arch.outputs import MoEArch
from moetool.compute.dtypes import DTYPES  # the dtype names every stage reads
from moetool.io.sources import ResolvedSource
from moetool.recipe.mofe import MoFERecipe

OpKind = Literal["copy", "expert", "shared", "router", "shared_gate", "zeros", "stacked", "null_gate"]
# a stacked op's sources: per expert, the (source label, tensor) pairs concatenated along dim 0, then stacked
Parts = tuple[tuple[tuple[str, str], ...], ...]


@dataclass(frozen=True)
class TensorOp:
    """One output tensor.

    Attributes:
        out: output tensor name.
        kind: how it is produced.
        source: label of the source checkpoint (``base``, an expert name, ``shared``), None for computed tensors.
        src: tensor name inside the source.
        shape: output shape.
        parts: for ``stacked`` (every expert in one tensor): per expert, the (source label, tensor) pairs it
            concatenates along dim 0.
    """

    out: str
    kind: OpKind
    source: str | None
    src: str | None
    shape: tuple[int, ...]
    parts: Parts = ()

    @property
    def origin(self) -> str | None:
        """The source label; for a stacked op its experts' labels joined by '+'; None for a computed tensor."""
        if self.parts:
            return "+".join(dict.fromkeys(label for row in self.parts for label, _ in row))
        return self.source

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class MergePlan:
    """A complete, weight-free description of a merge (what ``--dry-run`` prints)."""

    recipe: MoFERecipe
    arch: MoEArch
    config: dict[str, Any]
    ops: list[TensorOp]
    sources: dict[str, ResolvedSource]
    dtype: str
    warnings: list[str] = field(default_factory=list)
    allow_pickle: bool = False
    device: str = "auto"  # where hidden-state router initialisation runs the base (auto: a GPU when there is one)

    @property
    def element_size(self) -> int:
        return torch.tensor([], dtype=DTYPES[self.dtype]).element_size()

    @property
    def total_bytes(self) -> int:
        return sum(op.numel for op in self.ops) * self.element_size

    def bytes_by_kind(self) -> dict[str, int]:
        c: Counter[str] = Counter()
        for op in self.ops:
            c[op.kind] += op.numel * self.element_size
        return dict(c)

    def peak_memory_estimate(self) -> int:
        """Bytes held at once, beyond the Python runtime.

        Tensors stream one at a time (read, cast, written), so streaming holds about two copies of the largest tensor
        in float32. ``hidden`` gates load the base model in float32 first and free it before streaming starts.
        """
        largest = max((op.numel for op in self.ops), default=0) * 4
        if self.recipe.gate_mode != "hidden":
            return 2 * largest
        per_expert = sum(op.numel for op in self.ops if op.kind in ("expert", "stacked")) // len(self.recipe.experts)
        base = (sum(op.numel for op in self.ops if op.kind == "copy") + per_expert) * 4
        return max(2 * largest, base)
