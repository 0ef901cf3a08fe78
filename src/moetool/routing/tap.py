"""Observe (and optionally perturb) router inputs and logits with forward hooks, for any moetool output arch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch.utils.hooks import RemovableHandle

from moetool.compute.rows import feed_forward, rows_of
from moetool.errors import MoetoolError


class FusedExperts(Protocol):
    """An MoE layer's experts module in transformers 5's fused form."""

    gate_up_proj: torch.Tensor  # [E, 2·ff, H], gate rows first
    down_proj: torch.Tensor  # [E, H, ff]

    def act_fn(self, x: torch.Tensor, /) -> torch.Tensor: ...

    def register_forward_hook(self, hook: Callable[..., object], /) -> RemovableHandle: ...


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (``model.model.layers``)."""
    layers: torch.nn.ModuleList = getattr(model, "model").layers  # noqa: B009 - attributes nn.Module does not declare
    return list(layers)


moe_block = feed_forward  # a decoder layer's feed-forward block, MoE or dense (the name its callers here use)


def experts_modules(model: torch.nn.Module) -> dict[int, FusedExperts]:
    """Layer index → that layer's experts module, for every MoE layer in transformers 5's fused form
    (``gate_up_proj`` ``[E, 2·ff, H]``, gate rows first; ``down_proj`` ``[E, H, ff]``; ``act_fn``)."""
    out: dict[int, FusedExperts] = {}
    for i, layer in enumerate(decoder_layers(model)):
        experts = getattr(moe_block(layer), "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            out[i] = experts
    return out


def expert_activation(experts: FusedExperts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s intermediate activation ``act(gate(x)) · up(x)`` for tokens ``x`` ``[T, H]`` → ``[T, ff]``: the
    input of its down projection. The expert's matrix is cast to ``x``'s dtype (a stack held in 16 bits under float32
    arithmetic, :mod:`moetool.compute.narrow`; no copy when it is that dtype already)."""
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e].to(x.dtype)).chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _router(block: torch.nn.Module | None) -> torch.nn.Module | None:
    """The router module of an MoE block: ``gate`` or (GraniteMoE) ``router``; None in a dense block."""
    if not hasattr(block, "experts"):
        return None
    gate = getattr(block, "gate", None)
    return gate if gate is not None else getattr(block, "router", None)


def has_moe_layers(model: torch.nn.Module) -> bool:
    """True when any decoder layer's MLP holds experts (a merged MoE, any moetool output arch)."""
    return any(hasattr(moe_block(layer), "experts") for layer in getattr(model.model, "layers", []))


class RouterTap:
    """Forward hooks on every MoE layer's router: collect its logits ``[T, E]``; optionally jitter its input."""

    def __init__(self, model: torch.nn.Module, jitter: float = 0.0) -> None:
        self.routers = self.find_routers(model)
        # router → its block, whose slice (compute.rows.rows_of) says where a call's positions lie in the batch
        blocks = [moe_block(layer) for layer in decoder_layers(model)]
        self._blocks = {id(r): b for b in blocks if b is not None and (r := _router(b)) is not None}
        self.logits: list[torch.Tensor] = []
        self.keep: torch.Tensor | None = None  # [B*T] bool: the tokens to collect (None: all), e.g. not padding
        self.jitter = jitter
        self.generator = torch.Generator()
        self._handles = [r.register_forward_hook(self._capture) for r in self.routers]
        if jitter > 0:
            self._handles += [r.register_forward_pre_hook(self._jitter) for r in self.routers]

    @staticmethod
    def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
        """Every MoE layer's router module, in layer order.

        Raises:
            MoetoolError: the model has no MoE layers.
        """
        found = [_router(moe_block(layer)) for layer in decoder_layers(model)]
        routers = [r for r in found if r is not None]
        if not routers:
            raise MoetoolError("the model has no MoE layers with routers (is it a merged MoE checkpoint?)")
        return routers

    def _capture(self, mod: torch.nn.Module, _args: tuple[object, ...], output: tuple[torch.Tensor, ...]) -> None:
        logits = output[0]
        block = self._blocks.get(id(mod))
        part = rows_of(block) if block is not None else None
        first = part[0] if part is not None else 0
        if self.keep is not None or part is not None:
            logits = logits.reshape(-1, logits.shape[-1])
        if self.keep is not None:
            logits = logits[self.keep[first : first + logits.shape[0]]]
        if part is not None and first > 0:  # the next slice of one call (a streamed layer): one entry per call
            self.logits[-1] = torch.cat([self.logits[-1], logits])
        else:
            self.logits.append(logits)

    def _jitter(self, mod: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if not mod.training:
            return None
        x = args[0]
        noise = torch.empty(x.shape, dtype=x.dtype).uniform_(1 - self.jitter, 1 + self.jitter, generator=self.generator)
        return (x * noise.to(x.device), *args[1:])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
