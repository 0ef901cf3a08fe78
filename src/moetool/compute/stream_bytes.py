"""How many bytes of weights a model streamed from disk (:mod:`moetool.compute.stream`) holds at its peak."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moetool.compute.upcast import layer_bytes
from moetool.errors import MoetoolError

__all__ = ["HeldBytes", "held_bytes", "streamed_weight_bytes"]


@dataclass(frozen=True)
class HeldBytes:
    """What a streamed model of one checkpoint holds, in bytes: the weights outside the layer stack (``outside``),
    its largest decoder layer (``layer``), each as held (:mod:`moetool.compute.narrow`: expert stacks, embedding and
    head in their stored 16 bits, the rest in float32), and the most a layer adds while it is read or computes
    (``transient``: the float32 copies of the tensors transformers' loader converts itself and the tensor being
    read, or the largest expert matrix upcast for its product). ``head``: the head's float32 copy while it
    multiplies, after the last layer is dropped."""

    outside: int
    layer: int
    transient: int
    head: int

    @property
    def peak(self) -> int:
        return self.outside + max(self.layer + self.transient, self.head)


def streamed_weight_bytes(config: Mapping[str, object], params: int, path: Path | None = None) -> int:
    """Bytes of weights a streamed model holds at its peak: those outside the layer stack and one decoder layer, plus
    what reading or computing a layer adds.

    With the checkpoint's ``path``, worked out from its tensors as held (:func:`held_bytes`). Without it, or for a
    model built by code not registered here, everything in float32 and half a layer more (what transformers' own
    loading adds, 1.6× a layer of Mistral-7B's shape at its peak, where reading in place is 1.00×)."""
    held = held_bytes(Path(path), _stamp(Path(path))) if path is not None else None
    if held is None:
        outside, layer = layer_bytes(config, params)
        return outside + layer * 3 // 2
    return held.peak


def _stamp(path: Path) -> tuple[tuple[str, int, int], ...]:
    """The checkpoint's files, sizes and times: a new checkpoint at the same path is worked out again."""
    files = sorted([*path.glob("*.safetensors"), path / "config.json"])
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


@functools.lru_cache(maxsize=8)  # an estimate is asked for several batch sizes; building on meta takes seconds
def held_bytes(path: Path, _stamp: tuple[tuple[str, int, int], ...] = ()) -> HeldBytes | None:
    """:class:`HeldBytes` of the checkpoint in ``path`` (``_stamp`` keys the cache), or None where the model cannot be
    built here (an architecture transformers does not know, no safetensors)."""
    from moetool.compute.narrow import end_names, narrow_names, stack_names
    from moetool.compute.stream import meta_causal_lm

    try:
        meta = meta_causal_lm(Path(path))
    except (ValueError, KeyError, OSError, MoetoolError):
        return None
    loader = meta.loader
    loader.narrow = narrow_names(meta.model)
    stacks = stack_names(meta.model)
    head_name = end_names(meta.model)[1]

    def part(keys: list[str]) -> tuple[int, int, int, int]:
        """(bytes as held, largest upcast of one expert's matrix, what reading adds: the float32 copies of the
        tensors transformers' loader converts itself and the largest tensor as stored, the head's upcast)"""
        slices, stored, placement = loader.plan(keys)
        held = upcast = head_wide = 0
        for target, regions in placement.targets.items():
            sources = [slices[k] for k, _ in regions]
            numel = sum(math.prod(s.get_shape()) for s in sources)
            width = loader.held_dtype(target, sources).itemsize
            held += numel * width
            if target in stacks and width < 4:  # one expert's matrix at a time
                upcast = max(upcast, numel // loader.target_shape(target)[0] * 4)
            if target == head_name and width < 4:
                head_wide = numel * 4
        rest = sum(math.prod(slices[k].get_shape()) * 4 for k in placement.rest)
        return held + rest, upcast, 2 * rest + max(stored.values(), default=0), head_wide

    layers = [part(keys) for keys in meta.layer_keys.values()] or [(0, 0, 0, 0)]
    outside, _, _, head_wide = part(meta.outside)
    return HeldBytes(
        outside=outside,
        layer=max(p[0] for p in layers),
        transient=max(max(p[1], p[2]) for p in layers),
        head=head_wide,
    )
