"""An expert edit as a plan: every output tensor and the pieces of input tensors it is made of, before any weight is
read. Remove, prune, add and extract are all plans of this one form; :mod:`moetool.edit.execute` writes any of them.

Output tensors keep the input's file order. An added expert's tensors follow the last expert tensor of their layer,
so removing the expert just added gives back the input's order (and, for a folder moetool wrote, its bytes).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from moetool.arch.families import FAMILIES, MLP_PROJS, dense_config, dense_mlp_name
from moetool.arch.outputs import with_expert_count
from moetool.edit.layout import EditError, MoELayout

# a slot of the output: an input expert by its index, or the expert being added
Slot = int | Literal["new"]
_BIAS = re.compile(r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.bias")


@dataclass(frozen=True)
class Piece:
    """Part of an output tensor: input tensors concatenated along dim 0, after selecting and slicing each.

    Attributes:
        source: ``moe`` (the MoE being edited), ``new`` (the expert being added) or ``computed`` (router rows
            computed before writing, by key).
        names: the tensors (or the computed key).
        index: select this entry of dim 0 first (a router row, one expert of a stacked tensor).
        rows: then keep rows ``[a, b)`` of dim 0 (one projection of a stacked ``[gate; up]``).
    """

    source: Literal["moe", "new", "computed"]
    names: tuple[str, ...]
    index: int | None = None
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class EditOp:
    """One output tensor: its pieces stacked (a new dim 0) when ``stack``, else its single piece.

    Attributes:
        dtype: the safetensors dtype it is written in (an added expert takes the MoE's).
    """

    out: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    stack: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class EditPlan:
    """A complete, weight-free description of an edit (what ``--dry-run`` prints).

    Attributes:
        kind: add, remove, prune or extract.
        names: the output's expert names (empty for an extracted dense model).
        sources: ``moe`` and, for add, ``new`` (the dense expert, or the folder its adapter was baked into).
        record: what ``moetool.json``'s ``edits`` list gets for this edit.
        zero: tensors dropped from the output that must hold only zeros (biases a bias-free family lacks).
    """

    kind: str
    layout: MoELayout
    ops: list[EditOp]
    config: dict[str, Any]
    names: list[str]
    sources: dict[str, Path]
    record: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    zero: list[str] = field(default_factory=list)
    keep: dict[int, list[Slot]] = field(default_factory=dict)  # per MoE layer, the output's slots (select plans)

    @property
    def dense(self) -> bool:
        return self.kind == "extract"


def _expert_index(layout: MoELayout) -> dict[str, tuple[int, int, str]]:
    """Per-expert tensor name → (layer, expert, projection); empty for a stacked architecture."""
    if layout.arch.stacked:
        return {}
    return {
        t.name: (layer, e, t.proj[0])
        for layer in layout.moe_layers
        for e in range(layout.n_experts)
        for t in layout.expert_tensors(layer, e)
    }


def select_plan(
    layout: MoELayout,
    keep: dict[int, list[Slot]],
    *,
    kind: str,
    names: list[str],
    top_k: int,
    record: dict[str, Any],
    new: dict[str, tuple[int, ...]] | None = None,
) -> EditPlan:
    """The MoE with, in each MoE layer, the slots ``keep[layer]`` in that order (input experts by index, ``"new"`` for
    the expert being added, whose dense tensor shapes are ``new``).

    Raises:
        EditError: ``top_k`` larger than the experts left, or no expert left.
    """
    n = len(next(iter(keep.values())))
    if any(len(slots) != n for slots in keep.values()):
        raise EditError("every MoE layer must keep the same number of experts (one count in the config)")
    if n < 1:
        raise EditError("an edit must leave at least one expert")
    if top_k > n:
        raise EditError(
            f"{n} expert(s) would remain but the MoE routes each token to {top_k} (num_experts_per_tok); keep at least "
            f"{top_k}, or lower it with --top-k"
        )
    index = _expert_index(layout)
    remaining = {layer: sum(1 for name in index.values() if name[0] == layer) for layer in layout.moe_layers}
    ops: list[EditOp] = []
    for name, info in layout.tensors.items():
        if name in index:
            layer, e, proj = index[name]
            if e in keep[layer]:
                out = layout.arch.expert_name(layer, keep[layer].index(e), proj)
                ops.append(EditOp(out, info.shape, info.dtype, (Piece("moe", (name,)),)))
            remaining[layer] -= 1
            if remaining[layer] == 0:  # after the layer's last expert tensor: the added expert's
                for slot, s in enumerate(keep[layer]):
                    if s == "new":
                        for p in MLP_PROJS:
                            src = dense_mlp_name(layer, p)
                            shape = (new or {})[src]
                            ops.append(
                                EditOp(
                                    layout.arch.expert_name(layer, slot, p), shape, info.dtype, (Piece("new", (src,)),)
                                )
                            )
            continue
        stacked = _stacked_layer(layout, name)
        if stacked is not None:
            layer = stacked
            projs = next(p for t, p in layout.arch.stacked if t.format(layer=layer) == name)
            pieces = tuple(
                Piece("moe", (name,), index=s)
                if s != "new"
                else Piece("new", tuple(dense_mlp_name(layer, p) for p in projs))
                for s in keep[layer]
            )
            ops.append(EditOp(name, (n, *info.shape[1:]), info.dtype, pieces, stack=True))
            continue
        router = next((layer for layer in layout.moe_layers if layout.router(layer) == name), None)
        if router is not None:
            pieces = tuple(
                Piece("moe", (name,), index=s) if s != "new" else Piece("computed", (f"router.{router}",))
                for s in keep[router]
            )
            ops.append(EditOp(name, (n, *info.shape[1:]), info.dtype, pieces, stack=True))
            continue
        ops.append(EditOp(name, info.shape, info.dtype, (Piece("moe", (name,)),)))
    config = with_expert_count(layout.config, n, top_k)
    sources = {"moe": layout.path}
    return EditPlan(kind, layout, ops, config, names, sources, record, keep=keep)


def _stacked_layer(layout: MoELayout, name: str) -> int | None:
    for layer in layout.moe_layers:
        if any(t.format(layer=layer) == name for t, _ in layout.arch.stacked):
            return layer
    return None


def _is_shared(layout: MoELayout, name: str) -> bool:
    arch = layout.arch
    if arch.shared is None or arch.shared_gate is None:
        return False
    for layer in layout.moe_layers:
        if name == arch.shared_gate.format(layer=layer):
            return True
        if any(name == arch.shared.format(layer=layer, proj=p) for p in MLP_PROJS):
            return True
    return False


def _dense_target(layout: MoELayout, slot: int | Literal["shared"]) -> tuple[str, dict[str, Any]]:
    """The dense family and config an extracted expert gets: the base's own where moetool recorded it (and its MLP
    is the expert's width), else the family native to the architecture."""
    arch = layout.arch
    base_cfg = layout.meta.get("base_config")
    family = base_cfg.get("model_type") if isinstance(base_cfg, dict) else None
    if family not in FAMILIES:
        family, base_cfg = arch.dense_family(layout.config), None
    if slot == "shared" and arch.shared is not None:
        width = layout.tensors[arch.shared.format(layer=layout.moe_layers[0], proj="gate_proj")].shape[0]
    else:
        width = layout.width()
    if base_cfg is not None and int(base_cfg.get("intermediate_size") or 0) == width:
        return str(family), dict(base_cfg)
    return str(family), dense_config(layout.config, str(family), width)


def _check_dense_widths(layout: MoELayout, width: int) -> None:
    """A dense model has one MLP width: a dense layer of the MoE (``mlp_only_layers``) must have the expert's.

    Raises:
        EditError: naming the layer and both widths.
    """
    for layer in range(layout.n_layers):
        info = layout.tensors.get(dense_mlp_name(layer, "gate_proj"))
        if layer not in layout.moe_layers and info is not None and info.shape[0] != width:
            raise EditError(
                f"{layout.path}: dense layer {layer} has an MLP {info.shape[0]} wide, the experts {width}; one dense "
                "model cannot hold both widths"
            )


def extract_plan(layout: MoELayout, slot: int | Literal["shared"], record: dict[str, Any]) -> EditPlan:
    """Expert ``slot`` (or the shared expert) of every MoE layer as the MLP of a dense model of the base family.

    The family is the base's where moetool built the MoE (``moetool.json``'s ``base_config``), else the family
    native to the architecture. Attention biases the family lacks are dropped, and must be zero (checked when
    written).

    Raises:
        EditError: ``shared`` asked of an MoE without a real shared expert.
    """
    arch = layout.arch
    if slot == "shared" and not layout.shared:
        raise EditError(f"{layout.path}: the MoE has no shared expert to extract")
    family, config = _dense_target(layout, slot)
    _check_dense_widths(layout, int(config["intermediate_size"]))
    keeps_bias = FAMILIES[family].attention_bias or bool(config.get("attention_bias"))
    index = _expert_index(layout)
    ops: list[EditOp] = []
    zero: list[str] = []
    for name, info in layout.tensors.items():
        if _BIAS.fullmatch(name) and not keeps_bias:
            zero.append(name)
            continue
        if name in index:
            layer, e, proj = index[name]
            if e == slot:
                ops.append(EditOp(dense_mlp_name(layer, proj), info.shape, info.dtype, (Piece("moe", (name,)),)))
            continue
        stacked = _stacked_layer(layout, name)
        if stacked is not None:
            layer = stacked
            if slot != "shared":
                projs = next(p for t, p in arch.stacked if t.format(layer=layer) == name)
                rows = info.shape[1] // len(projs)
                for j, p in enumerate(projs):
                    piece = Piece("moe", (name,), index=slot, rows=(j * rows, (j + 1) * rows))
                    ops.append(EditOp(dense_mlp_name(layer, p), (rows, *info.shape[2:]), info.dtype, (piece,)))
            continue
        if any(layout.router(layer) == name for layer in layout.moe_layers):
            continue
        if _is_shared(layout, name):
            if slot == "shared" and arch.shared is not None and not name.endswith("shared_expert_gate.weight"):
                layer = int(name.split(".")[2])
                proj = next(p for p in MLP_PROJS if arch.shared.format(layer=layer, proj=p) == name)
                ops.append(EditOp(dense_mlp_name(layer, proj), info.shape, info.dtype, (Piece("moe", (name,)),)))
            continue
        ops.append(EditOp(name, info.shape, info.dtype, (Piece("moe", (name,)),)))
    ops = _dense_order(ops)
    warnings = []
    if layout.shared and slot != "shared":
        warnings.append(
            "the MoE has a shared expert, which every token also runs; the extracted model holds the routed expert "
            "alone (extract `shared` for the shared one)"
        )
    name = "shared" if slot == "shared" else layout.names[slot]
    keep: dict[int, list[Slot]] = {layer: [slot] for layer in layout.moe_layers} if slot != "shared" else {}
    return EditPlan(
        "extract", layout, ops, config, [], {"moe": layout.path}, record | {"expert": name}, warnings, zero, keep
    )


def _dense_order(ops: list[EditOp]) -> list[EditOp]:
    """A dense layer's MLP projections in gate, up, down order after its other tensors (as the merge reads them)."""
    mlp = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight")
    order = {p: i for i, p in enumerate(MLP_PROJS)}
    out: list[EditOp] = []
    pending: dict[int, list[EditOp]] = {}
    for op in ops:
        m = mlp.fullmatch(op.out)
        if m:
            pending.setdefault(int(m.group(1)), []).append(op)
            continue
        layer = re.match(r"model\.layers\.(\d+)\.", op.out)
        for done in [k for k in pending if layer is None or int(layer.group(1)) > k]:
            out += sorted(pending.pop(done), key=lambda o: order[o.out.rsplit(".", 2)[-2]])
        out.append(op)
    for k in sorted(pending):
        out += sorted(pending.pop(k), key=lambda o: order[o.out.rsplit(".", 2)[-2]])
    return out
