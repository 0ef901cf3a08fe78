"""Where an MoE folder keeps its experts, read from its architecture record and tensor headers (no weights).

Works on moetool's outputs and on third-party folders of every output architecture moetool writes: per-expert tensors
(Mixtral, Qwen2-MoE, Qwen3-MoE) or one stacked tensor per layer and group (GraniteMoE). Layers without a router (a
Qwen2-MoE's ``mlp_only_layers``) are dense and left alone by every edit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetool.arch.families import MLP_PROJS
from moetool.arch.outputs import NULL_SHARED_KEY, MoEArch, expert_count, output_arch
from moetool.errors import MoetoolError
from moetool.io.checkpoint import Checkpoint, TensorInfo
from moetool.io.safe import read_json


class EditError(MoetoolError):
    """An expert edit that cannot be done exactly, or an input that is not what it must be."""


# transformers 5's in-memory fused layout; a folder saved that way has no per-expert tensors to edit
_FUSED = re.compile(r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertTensor:
    """One tensor holding (part of) an expert: ``name`` alone, or row ``index`` of a stacked tensor.

    Attributes:
        proj: the dense projections it holds, concatenated along dim 0 (``gate_proj`` or ``gate_proj, up_proj``).
    """

    name: str
    index: int | None
    proj: tuple[str, ...]


@dataclass
class MoELayout:
    """An MoE folder's experts as data.

    Attributes:
        names: one name per expert slot: moetool.json's where moetool built it, else the indices as strings.
        moe_layers: decoder layers with a router.
        tensors: every tensor's header, in file order.
        meta: moetool.json (empty for a third-party folder).
        shared: a real shared expert (not the null one moetool writes in Qwen2-MoE's place for none).
    """

    path: Path
    config: dict[str, Any]
    arch: MoEArch
    n_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    names: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    meta: dict[str, Any] = field(default_factory=dict)
    shared: bool = False

    @property
    def n_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def dtype(self) -> str:
        """The safetensors dtype of the experts (what an added expert is cast to)."""
        return self.tensors[self.expert_tensors(self.moe_layers[0], 0)[0].name].dtype

    def router(self, layer: int) -> str:
        return self.arch.router_name(layer)

    def expert_tensors(self, layer: int, expert: int) -> list[ExpertTensor]:
        """The tensors of ``expert`` in ``layer``, in the order the architecture writes them."""
        if self.arch.stacked:
            return [ExpertTensor(t.format(layer=layer), expert, projs) for t, projs in self.arch.stacked]
        return [ExpertTensor(self.arch.expert_name(layer, expert, p), None, (p,)) for p in MLP_PROJS]

    def expert_names(self, layer: int) -> set[str]:
        """Every tensor name that holds routed experts (or their router) in ``layer``."""
        names = {self.router(layer)}
        for e in range(self.n_experts if not self.arch.stacked else 1):
            names |= {t.name for t in self.expert_tensors(layer, e)}
        return names

    def width(self) -> int:
        """An expert's intermediate width."""
        first = self.expert_tensors(self.moe_layers[0], 0)[0]
        rows = self.tensors[first.name].shape[1 if first.index is not None else 0]
        return int(rows // len(first.proj))

    def resolve(self, ref: str) -> int:
        """The slot of an expert named ``ref`` (a name from moetool.json, or an index).

        Raises:
            EditError: no such expert, listing the known ones.
        """
        if ref in self.names:
            return self.names.index(ref)
        if ref.lstrip("-").isdigit():
            i = int(ref)
            if 0 <= i < self.n_experts:
                return i
            raise EditError(f"{self.path}: expert index {i} is out of range (the MoE has {self.n_experts} experts)")
        known = ", ".join(f"{i}={n}" for i, n in enumerate(self.names))
        raise EditError(f"{self.path}: no expert {ref!r} (experts: {known})")


def has_tokenizer(path: Path) -> bool:
    """Whether a model folder carries a tokenizer."""
    return any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def require_tokenizer(path: Path, why: str) -> None:
    """Refuse a folder without a tokenizer for a step that reads text.

    Raises:
        EditError: naming the folder and the step.
    """
    if not has_tokenizer(path):
        raise EditError(f"{path} has no tokenizer, which {why} needs; copy the base model's tokenizer files into it")


def _names(meta: dict[str, Any], n: int) -> tuple[str, ...]:
    names = meta.get("experts")
    if isinstance(names, list) and len(set(names)) == len(names) == n and all(isinstance(x, str) for x in names):
        return tuple(names)
    return tuple(str(i) for i in range(n))


def read_layout(path: Path) -> MoELayout:
    """The expert layout of the MoE folder ``path`` (config, moetool.json and safetensors headers only).

    Raises:
        EditError: not an MoE of an architecture moetool writes, an expert tensor missing or shaped differently
            from its siblings, or transformers' fused in-memory layout.
    """
    path = Path(path)
    ck = Checkpoint(path)
    try:
        cfg = ck.config
        tensors = dict(sorted(ck.tensors.items(), key=lambda kv: (kv[1].file.name, kv[1].offset)))
    finally:
        ck.close()
    arch = output_arch(cfg.get("model_type"))
    n = expert_count(cfg)
    if arch is None or n == 0:
        raise EditError(
            f"{path}: model_type {cfg.get('model_type')!r} is not an MoE moetool can edit "
            "(Mixtral, Qwen2-MoE, Qwen3-MoE or GraniteMoE)"
        )
    fused = next((name for name in tensors if _FUSED.match(name)), None)
    if fused:
        raise EditError(
            f"{path}: {fused} holds every expert fused (transformers' in-memory layout); load and re-save the "
            "folder with transformers to get the per-expert layout"
        )
    layers = tuple(i for i in range(int(cfg["num_hidden_layers"])) if arch.router_name(i) in tensors)
    if not layers:
        raise EditError(f"{path}: no router tensor ({arch.router_name(0)}) in any layer: not a {arch.name} MoE")
    meta_file = path / "moetool.json"
    meta = read_json(meta_file, what="moetool metadata") if meta_file.is_file() else {}
    _check_edits(meta_file, meta)
    top_k = int(cfg.get("num_experts_per_tok") or 1)
    shared = (
        arch.shared is not None
        and not cfg.get(NULL_SHARED_KEY)
        and arch.shared.format(layer=layers[0], proj="gate_proj") in tensors
    )
    layout = MoELayout(path, cfg, arch, n, top_k, layers, _names(meta, n), tensors, meta, shared)
    _check_complete(layout)
    return layout


def _check_edits(meta_file: Path, meta: dict[str, Any]) -> None:
    """``edits`` (the history every edit appends to, and ``list`` and the card print) must be a list of objects.

    Raises:
        EditError: naming the file, the field and what it holds instead.
    """
    edits = meta.get("edits", [])
    if not isinstance(edits, list):
        raise EditError(f"{meta_file}: edits must be a list of edit records, not {type(edits).__name__}")
    bad = next((i for i, e in enumerate(edits) if not isinstance(e, dict)), None)
    if bad is not None:
        raise EditError(
            f"{meta_file}: edits[{bad}] must be an edit record (a JSON object), not {type(edits[bad]).__name__}"
        )


def _check_complete(layout: MoELayout) -> None:
    """Every expert tensor exists with its siblings' shape, every router has one row per expert."""
    problems = []
    first: dict[tuple[str, ...], tuple[int, ...]] = {}
    for layer in layout.moe_layers:
        router = layout.tensors[layout.router(layer)]
        if router.shape[0] != layout.n_experts:
            problems.append(f"{router.name} has {router.shape[0]} rows for {layout.n_experts} experts")
        for e in range(layout.n_experts):
            for t in layout.expert_tensors(layer, e):
                info = layout.tensors.get(t.name)
                if info is None:
                    problems.append(f"missing tensor {t.name}")
                    continue
                shape = info.shape[1:] if t.index is not None else info.shape
                if t.index is not None and info.shape[0] != layout.n_experts:
                    problems.append(f"{t.name} stacks {info.shape[0]} experts, the config says {layout.n_experts}")
                if first.setdefault(t.proj, shape) != shape:
                    problems.append(f"{t.name} has shape {list(shape)}, other experts {list(first[t.proj])}")
        if len(problems) > 8:
            break
    if problems:
        raise EditError(f"{layout.path}: not a complete {layout.arch.name} MoE:\n  " + "\n  ".join(problems[:8]))
