"""Which parameters train: glob patterns over parameter names plus presets, checked against the model."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moetool.errors import MoetoolError

# Patterns over transformers' in-memory names (v5 fuses experts: ``model.layers.N.mlp.experts.gate_up_proj``).
PRESETS: dict[str, dict[str, list[str]]] = {
    # MoFE: experts (and a shared expert) frozen; routers, attention, embeddings, norms, head trainable
    "mofe": {
        "trainable": ["*"],
        "frozen": ["*.mlp.experts.*", "*.mlp.shared_expert.*", "*.block_sparse_moe.experts.*"],
    },
    "router_only": {
        "trainable": ["*.mlp.gate.weight", "*.mlp.shared_expert_gate.weight", "*.block_sparse_moe.router.weight"],
        "frozen": [],
    },
    "full": {"trainable": ["*"], "frozen": []},
}


class FreezeError(MoetoolError):
    """A freeze specification does not fit the model."""


@dataclass(frozen=True)
class FreezeReport:
    trainable: list[str]
    frozen: list[str]
    trainable_params: int
    frozen_params: int


def apply_freeze(
    model: torch.nn.Module, preset: str | None = None, trainable: Iterable[str] = (), frozen: Iterable[str] = ()
) -> FreezeReport:
    """Set ``requires_grad``: a parameter trains if it matches a trainable pattern and no frozen pattern.

    The preset's patterns come first, then the user's. A user pattern that matches nothing is an error (a typo would
    otherwise silently train or freeze the wrong thing); preset patterns may not apply to every architecture.

    Raises:
        FreezeError: a user pattern matches no parameter (naming it), or nothing would train.
    """
    user_t, user_f = list(trainable), list(frozen)
    trainable, frozen = list(user_t), list(user_f)
    if preset is not None:
        if preset not in PRESETS:
            raise FreezeError(f"freeze.preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        trainable = PRESETS[preset]["trainable"] + user_t
        frozen = PRESETS[preset]["frozen"] + user_f
    names = [n for n, _ in model.named_parameters()]
    for kind, pats in (("trainable", user_t), ("frozen", user_f)):
        for pat in pats:
            if not any(fnmatch.fnmatchcase(n, pat) for n in names):
                sample = ", ".join(names[:4])
                raise FreezeError(f"freeze.{kind}: pattern {pat!r} matches no parameter (names look like: {sample}, …)")
    t_names, f_names, t_count, f_count = [], [], 0, 0
    for name, p in model.named_parameters():
        train = any(fnmatch.fnmatchcase(name, pat) for pat in trainable) and not any(
            fnmatch.fnmatchcase(name, pat) for pat in frozen
        )
        p.requires_grad_(train)
        if train:
            t_names.append(name)
            t_count += p.numel()
        else:
            f_names.append(name)
            f_count += p.numel()
    if not t_names:
        raise FreezeError("freeze: no parameter is left trainable")
    return FreezeReport(t_names, f_names, t_count, f_count)
