"""Where each checkpoint tensor lands in a model's parameters, so a layer can be read straight into its final memory.

transformers 5 loads a Mixtral- or Qwen-MoE-style checkpoint by reading every expert's matrices, stacking them and
concatenating gate with up: three float32 copies of the experts at once, 1.6× a layer's float32 bytes at its peak
(measured on a four-expert layer of Mistral-7B's shape: 4.8 GB of transient memory for a 3.0 GB layer). This module
asks transformers' own conversion mapping where each key goes (its renamings, and which converter and source
pattern match) and, for the conversions that only rename, stack experts (``MergeModulelist(dim=0)``) or stack then
concatenate along the rows (``Concatenate(dim=1)``), computes the region of the target parameter each key fills.
The caller allocates each parameter once and copies every tensor into its region as it is read: the peak is the
layer plus one tensor. Any other conversion (transposes, rope permutations, quantized formats) is left to
transformers' loader, which then handles those keys as before.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Region = tuple[int | slice, ...]  # an index into the target parameter


@dataclass(frozen=True)
class Placement:
    """Target parameter name → ``(checkpoint key, region)`` of every key that fills it, and the keys left to
    transformers' own conversions (``rest``)."""

    targets: dict[str, list[tuple[str, Region]]]
    rest: list[str]


def _natural(key: str) -> list[tuple[int, int | str]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]


def place(
    model: PreTrainedModel, shapes: dict[str, tuple[int, ...]], conversions: list[object], meta: dict[str, torch.Tensor]
) -> Placement:
    """Where ``shapes``'s keys (checkpoint name → shape) land in ``model`` under ``conversions`` (transformers'
    mapping for the model), given ``meta``, the model's state dict on ``meta``.

    A target is placed only when its keys exactly tile it (every region in bounds, the element counts adding up);
    otherwise its keys go to ``rest``.
    """
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = model.base_model_prefix
    groups: dict[str, dict[str | None, list[str]]] = defaultdict(lambda: defaultdict(list))
    rest: list[str] = []
    for key in sorted(shapes, key=_natural):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:
            target, pattern = key, None
        if target not in meta:
            rest.append(key)
            continue
        groups[target][pattern].append(key)
    targets: dict[str, list[tuple[str, Region]]] = {}
    for target, by in groups.items():
        regions = _tile(by, shapes, tuple(meta[target].shape), by_pattern)
        if regions is None:
            rest += [k for keys in by.values() for k in keys]
        else:
            targets[target] = regions
    return Placement(targets, rest)


def _tile(
    by: dict[str | None, list[str]],
    shapes: dict[str, tuple[int, ...]],
    want: tuple[int, ...],
    by_pattern: Mapping[str, object],
) -> list[tuple[str, Region]] | None:
    """The regions of a ``want``-shaped target that its keys (grouped by the source pattern they matched, None for a
    plain rename) fill, or None when they do not tile it by a plain copy, a stack, or a stack then concatenation."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    if None in by:
        keys = by[None]
        return [(keys[0], ())] if list(by) == [None] and len(keys) == 1 and shapes[keys[0]] == want else None
    conv = by_pattern[next(p for p in by if p is not None)]
    ops = [(type(op), getattr(op, "dim", None)) for op in conv.operations]  # type: ignore[attr-defined]
    patterns: list[str] = conv.source_patterns  # type: ignore[attr-defined]
    if ops == [(MergeModulelist, 0)] and len(patterns) == 1:
        keys = by.get(patterns[0], [])
        if len(keys) != want[0] or any(shapes[k] != want[1:] for k in keys):
            return None
        return [(k, (e,)) for e, k in enumerate(keys)]  # transformers stacks in the keys' natural order
    if ops != [(MergeModulelist, 0), (Concatenate, 1)] or set(by) != set(patterns):
        return None
    regions: list[tuple[str, Region]] = []
    row = 0
    for pattern in patterns:  # transformers concatenates in the patterns' order
        keys = by[pattern]
        rows = shapes[keys[0]][0]
        if len(keys) != want[0] or any(shapes[k] != (rows, *want[2:]) for k in keys):
            return None
        regions += [(k, (e, slice(row, row + rows))) for e, k in enumerate(keys)]
        row += rows
    return regions if row == want[1] else None


def set_parameter(model: PreTrainedModel, name: str, value: torch.Tensor) -> None:
    """Put ``value`` in ``model`` as parameter (or buffer) ``name``, keeping the parameter's ``requires_grad``."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = module._parameters.get(attr)
    if old is not None:
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[attr] = value
