"""Write an edit plan: one output tensor in memory at a time, into a folder :func:`moetool.edit.run.run` moves into
place when complete and checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from moetool.arch.released import released_config
from moetool.card import put_section
from moetool.edit.layout import EditError
from moetool.edit.plan import EditOp, EditPlan, Piece
from moetool.io.checkpoint import SAFETENSORS_DTYPES, Checkpoint
from moetool.io.files import TOKENIZER_FILES
from moetool.io.safe import read_text
from moetool.io.writer import ShardedWriter
from moetool.progress import task
from moetool.recipe.kept import KEPT_RECIPE

# files of an MoE folder an edit carries over as they are (the weights, config, card and moetool.json are rewritten)
CARRIED = (*TOKENIZER_FILES, "LICENSE", "LICENSE.txt", "NOTICE", KEPT_RECIPE, "moetool-train-recipe.yaml")
MAX_SHARD = 2_000_000_000


def check_not_input(out: Path, inputs: list[Path]) -> None:
    """Refuse an output that is an input folder or lies inside (or around) one: inputs are never written.

    Raises:
        EditError: naming the output and the input.
    """
    target = Path(out).resolve()
    for src in inputs:
        s = Path(src).resolve()
        if target == s or s in target.parents or target in s.parents:
            raise EditError(f"-o {out}: overlaps the input {src}; write the edited model somewhere else")


def _piece(piece: Piece, ckpts: dict[str, Checkpoint], computed: dict[str, torch.Tensor]) -> torch.Tensor:
    if piece.source == "computed":
        parts = [computed[n] for n in piece.names]
    else:
        parts = [ckpts[piece.source].get(n) for n in piece.names]
    if piece.index is not None:
        parts = [p[piece.index] for p in parts]
    if piece.rows is not None:
        a, b = piece.rows
        parts = [p[a:b] for p in parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _tensor(op: EditOp, ckpts: dict[str, Checkpoint], computed: dict[str, torch.Tensor]) -> torch.Tensor:
    dtype = SAFETENSORS_DTYPES[op.dtype][0]
    parts = [_piece(p, ckpts, computed).to(dtype) for p in op.pieces]
    t = torch.stack(parts) if op.stack else parts[0]
    if tuple(t.shape) != op.shape:
        raise EditError(f"{op.out}: got shape {list(t.shape)}, planned {list(op.shape)}")
    return t.contiguous()


def _check_zero(plan: EditPlan, ck: Checkpoint) -> None:
    for name in plan.zero:
        if bool(ck.get(name).any()):
            raise EditError(
                f"{plan.layout.path}: {name} is not zero, and the dense family the expert is extracted as has no "
                "attention biases; the extracted model would compute something else"
            )


def stream(
    plan: EditPlan, tmp: Path, computed: dict[str, torch.Tensor], console: Console, max_shard: int = MAX_SHARD
) -> None:
    """Write every planned tensor into safetensors shards under ``tmp``, one at a time."""
    ckpts = {label: Checkpoint(path) for label, path in plan.sources.items()}
    try:
        _check_zero(plan, ckpts["moe"])
        entries = [(op.out, SAFETENSORS_DTYPES[op.dtype][0], op.shape) for op in plan.ops]
        with (
            task(console, f"{plan.kind}: writing tensors", len(plan.ops), unit="tensors") as advance,
            ShardedWriter(tmp, entries, max_shard) as writer,
        ):
            for op in plan.ops:
                writer.add(op.out, _tensor(op, ckpts, computed))
                advance()
    finally:
        for c in ckpts.values():
            c.close()


def _card(plan: EditPlan, meta: dict[str, Any]) -> str:
    """The input's card with its "Edits" section rewritten from every edit in ``meta``."""
    card_file = plan.layout.path / "README.md"
    card = (  # a third-party folder's card may not be UTF-8: named, not a UnicodeDecodeError
        read_text(card_file, what="model card", error=EditError)
        if card_file.is_file()
        else f"# {meta.get('name', 'MoE')}\n\n"
    )
    lines = ["Changed after it was built, with `moetool experts` (details in `moetool.json`):\n"]
    lines += [f"{i}. {e.get('summary', e.get('op'))}" for i, e in enumerate(meta.get("edits", []), 1)]
    return put_section(card, "Edits", "\n".join(lines) + "\n\n")


def write_metadata(plan: EditPlan, tmp: Path) -> None:
    """config.json, the carried files, moetool.json with this edit appended to ``edits``, and the card."""
    src = plan.layout.path
    (tmp / "config.json").write_text(json.dumps(released_config(plan.config), indent=2, sort_keys=True))
    for name in CARRIED:
        f = src / name
        if f.is_file() and not f.is_symlink():
            shutil.copy2(f, tmp / name)
    meta = dict(plan.layout.meta)
    meta.setdefault("name", src.resolve().name)
    if plan.dense:
        meta = {
            "name": f"{meta['name']}-{plan.record['expert']}",
            "extracted_from": {"moe": str(src.resolve()), "name": meta["name"], "edits": meta.get("edits", [])},
            "edits": [plan.record],
        }
    else:
        meta["experts"] = plan.names
        meta["edits"] = [*meta.get("edits", []), plan.record]
    (tmp / "moetool.json").write_text(json.dumps(meta, indent=2))
    (tmp / "README.md").write_text(_card(plan, meta), encoding="utf-8")
