"""Float32 arithmetic over a model held in 16 bits: each decoder layer is upcast while it runs.

A verification reference must not carry rounding of its own, but a bf16 MoE of 5B parameters is 21 GB in float32.
bf16 and f16 values are exact in float32, so upcasting one layer for its forward and casting it back loses nothing:
the logits equal a whole float32 model's, with memory for the 16-bit model plus one float32 layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the module list holding most of its parameters.

    Raises:
        ValueError: the model has no module list (nothing to run layer by layer).
    """
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no stack of layers to run one at a time")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def float32_layer_by_layer(model: nn.Module) -> nn.Module:
    """Make ``model`` compute in float32, holding one decoder layer in float32 at a time (a float32 model as it is).

    Everything outside the layer stack (embeddings, final norm, head, rotary tables) becomes float32 at once, so the
    hidden states, attention masks and position tables are float32 from the start; each layer is cast to float32 by a
    forward pre-hook and back to its storage dtype after. Returns ``model``, changed in place.
    """
    layers = decoder_layers(model)
    if all(p.dtype == torch.float32 for p in layers.parameters()):
        return model
    in_layers = {id(t) for t in layers.parameters()} | {id(t) for t in layers.buffers()}
    for module in model.modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if id(t) in in_layers or t is None or not t.is_floating_point():
                continue
            if isinstance(t, nn.Parameter):
                t.data = t.data.float()  # in place: a tied head keeps sharing the embedding
            else:
                setattr(module, name, t.float())
    for layer in layers:
        storage = next(layer.parameters()).dtype

        def up(module: nn.Module, args: Any) -> None:
            module.float()

        def down(module: nn.Module, args: Any, output: Any, storage: torch.dtype = storage) -> None:
            module.to(storage)

        layer.register_forward_pre_hook(up)
        layer.register_forward_hook(down)
    return model


def float32_overhead(params: int, config: dict[str, Any]) -> int:
    """Bytes that :func:`float32_layer_by_layer` adds to a 16-bit model of ``params`` parameters: the embeddings and
    head in float32 instead of 16 bits, and one decoder layer's float32 copy while it runs (from the config: a
    layer's share of the parameters outside the embeddings)."""
    c = config.get("text_config") or config
    embed = int(c.get("vocab_size") or 0) * int(c.get("hidden_size") or 0)
    outside = min(params, embed * (1 if c.get("tie_word_embeddings", True) else 2))
    layer = (params - outside) // max(1, int(c.get("num_hidden_layers") or 1))
    return outside * 2 + layer * 4
