"""A streamed layer's largest tensors held as stored (16 bits) and computed in float32 a piece at a time.

A streamed model (:mod:`moetool.compute.stream`) computes in float32. Read in float32, a four-expert layer of
Mistral-7B's shape is 2.98 GB, 2.82 GB of it the expert stacks (transformers 5's ``gate_up_proj [E, 2F, D]`` and
``down_proj [E, D, F]``), and the embedding and head outside the layers are 1.61 GB at SmolLM2's vocabulary. Held as
the checkpoint stores them (bf16 or f16, exact in float32), those are half the bytes, and each piece is upcast only
while it computes:

- an expert stack, one expert's matrix at a time (:func:`compute_by_expert`: the chosen experts' loop that
  transformers' eager implementation runs, each matrix upcast before its product): 0.47 GB for the largest at that
  shape;
- the embedding's rows as they are looked up (its output cast to float32);
- the head's weight for its product (it runs after the last layer is dropped).

The values multiplied are the float32 values of the float32 path, in the same products and the same order, so the
logits are the same bit for bit (``tests/compute/test_stream.py``; ``tests/compute/test_narrow.py`` checks what is
held and upcast).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "SIXTEEN",
    "compute_by_expert",
    "end_names",
    "expert_stacks",
    "narrow_names",
    "stack_names",
    "upcast_outside",
]

SIXTEEN = {"BF16": torch.bfloat16, "F16": torch.float16}  # safetensors' names of the 16-bit dtypes held as stored
_STACKS = ("gate_up_proj", "up_proj", "down_proj")


def expert_stacks(model: nn.Module) -> dict[str, nn.Module]:
    """Name → module of every experts module in transformers 5's stacked form that :func:`compute_by_expert` can
    run: one built through transformers' experts-implementation switch (it carries ``has_gate`` and
    ``is_transposed``) with 3-D ``down_proj`` and ``gate_up_proj`` (or ``up_proj`` without a gate)."""
    found: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if not all(hasattr(m, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts")):
            continue
        stacks = [getattr(m, "gate_up_proj" if m.has_gate else "up_proj", None), getattr(m, "down_proj", None)]
        if all(isinstance(s, torch.Tensor) and s.dim() == 3 for s in stacks):
            found[name] = m
    return found


def stack_names(model: nn.Module) -> set[str]:
    """The parameter names of every expert stack's weights (:func:`expert_stacks`; not their biases)."""
    return {f"{n}.{p}" for n, m in expert_stacks(model).items() for p in _STACKS if hasattr(m, p)}


def end_names(model: nn.Module) -> tuple[str | None, str | None]:
    """The weight names of the input embedding and of the output head (None where the model has none)."""
    modules = {id(m): n for n, m in model.named_modules()}
    ends = (model.get_input_embeddings(), model.get_output_embeddings())  # type: ignore[operator]
    embed, head = (f"{modules[id(m)]}.weight" if m is not None and id(m) in modules else None for m in ends)
    return embed, head


def narrow_names(model: nn.Module) -> set[str]:
    """The parameters held as stored: every expert stack's weights (:func:`stack_names`), the input embedding's and
    the output head's (:func:`end_names`)."""
    return stack_names(model) | {n for n in end_names(model) if n is not None}


def _product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``x [T, in]`` times one expert's matrix (``[out, in]``, or ``[in, out]`` transposed) plus its bias."""
    out = x @ w if transposed else nn.functional.linear(x, w)
    return out if bias is None else out + bias


def _by_expert(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
    """transformers' eager experts loop (``hidden_states [T, H]``, ``top_k_index``/``top_k_weights [T, k]``), each
    chosen expert's matrices cast to the hidden states' dtype as it runs."""
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    up_name = "gate_up_proj" if self.has_gate else "up_proj"
    for row in hit:
        e = int(row[0])
        if e == self.num_experts:  # the expert-parallel sentinel: no expert here
            continue
        top_k_pos, token_idx = torch.where(mask[e])
        x = hidden_states[token_idx]
        bias = getattr(self, f"{up_name}_bias")[e] if self.has_bias else None
        h = _product(x, getattr(self, up_name)[e].to(x.dtype), bias, self.is_transposed)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        bias = self.down_proj_bias[e] if self.has_bias else None
        h = _product(h, self.down_proj[e].to(x.dtype), bias, self.is_transposed)
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        h = h * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))
    return final


def compute_by_expert(module: nn.Module) -> None:
    """Make an experts module of :func:`expert_stacks` run its chosen experts one at a time, each expert's matrices
    upcast (to the hidden states' dtype) only while they multiply: its stacks can then be held in 16 bits."""
    module.forward = _by_expert.__get__(module)  # an instance attribute: nn.Module.__call__ runs it


def _swap_wide(module: nn.Module, _args: object) -> None:
    weight = module._parameters["weight"]
    assert weight is not None
    module.__dict__["_moetool_narrow"] = weight.data
    weight.data = weight.data.float()


def _swap_narrow(module: nn.Module, _args: object, _out: object) -> None:
    weight = module._parameters["weight"]
    assert weight is not None
    weight.data = module.__dict__.pop("_moetool_narrow")


def _embedded_wide(_module: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
    return out.float()


def upcast_outside(model: nn.Module) -> None:
    """Hooks that make a 16-bit input embedding give float32 rows and a 16-bit head multiply in float32 (its weight
    upcast for the call, put back after): what lies outside the layers can then be held as stored."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    if embed is not None and embed.weight.dtype in SIXTEEN.values():
        embed.register_forward_hook(_embedded_wide)
    if head is not None and head.weight.dtype in SIXTEEN.values():
        head.register_forward_pre_hook(_swap_wide)
        head.register_forward_hook(_swap_narrow)
