"""Every edit checks itself against its input, run by transformers, before the output is moved into place.

The reference is the input model with its routing restricted by forward hooks on the routers: each router's own
forward runs over the allowed rows alone and its choice is mapped back to the input's expert indices, so the top-k
is taken and weighted exactly as the architecture does (renormalised, or as ``norm_topk_prob`` says). So:

* remove / prune: the output equals the input restricted to the kept experts: a removed expert's tokens go to the
  remaining ones exactly as the architecture would send them;
* add: the output restricted to its old experts equals the input (nothing else moved); and, where the added expert
  shares the MoE's attention, the output restricted to the new expert equals the dense source model;
* extract: the dense output equals the input restricted to that expert (weight 1), its shared expert silenced.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from moetool.routing.tap import RouterTap, decoder_layers, moe_block

# max |Δlogit| an edit may show against its reference: both run in float32 arithmetic (16-bit weights upcast one
# layer at a time), so what is left is float32 sums in another order
TOLERANCE = 1e-3


def _restrict(model: torch.nn.Module, allowed: Mapping[int, Sequence[int]]) -> list[RemovableHandle]:
    """Forward hooks that replace each MoE layer's routing with one over ``allowed[layer]`` only."""
    handles = []
    routers = RouterTap.find_routers(model)
    layers = [i for i, layer in enumerate(decoder_layers(model)) if hasattr(moe_block(layer), "experts")]
    for layer, router in zip(layers, routers, strict=True):
        keep = allowed.get(layer)
        if keep is None:
            continue
        index = torch.tensor(sorted(keep), dtype=torch.long)

        def hook(mod: Any, args: Any, output: Any, index: torch.Tensor = index) -> tuple[Any, Any, Any]:
            # the router's own forward over the allowed rows alone: the same shapes, kernels and summation order as
            # the edited router, so the reference routes exactly as the edited model does (a softmax over −∞ columns
            # sums in another order, and one ulp of a routing weight grows through a deep bf16 model)
            sub = copy.copy(mod)
            sub._parameters = dict(mod._parameters)
            sub._parameters["weight"] = torch.nn.Parameter(mod.weight[index.to(mod.weight.device)], requires_grad=False)
            sub.num_experts = len(index)
            sub.top_k = min(mod.top_k, len(index))  # one allowed expert (extract, the added one alone): weight 1
            _logits, scores, chosen = type(mod).forward(sub, *args)
            return output[0], scores, index.to(chosen.device)[chosen]

        handles.append(router.register_forward_hook(hook))
    return handles


def _silence_shared(model: torch.nn.Module) -> list[RemovableHandle]:
    """Hooks that zero every shared expert's output (the extracted model holds the routed expert alone)."""
    handles = []
    for layer in decoder_layers(model):
        shared = getattr(moe_block(layer), "shared_expert", None)
        if shared is not None:
            handles.append(shared.register_forward_hook(lambda _m, _a, out: torch.zeros_like(out)))
    return handles


@torch.inference_mode()
def logits(
    path: Path,
    ids: list[int],
    *,
    allowed: Mapping[int, Sequence[int]] | None = None,
    silence_shared: bool = False,
    device: str | None = None,
    streamed: bool = False,
) -> torch.Tensor:
    """Float32 logits ``[T, V]`` of the model at ``path`` on ``ids``, its routing restricted to ``allowed``.

    The model is held in its own dtype and computes in float32 (a 16-bit model one float32 layer at a time): 16-bit
    arithmetic alone moves a deep model's logits by more than any edit may (1.6 at 24 layers of random weights).
    ``streamed``: its layers are read from disk as each runs (:mod:`moetool.compute.stream`; the same logits).
    """
    from transformers import AutoModelForCausalLM

    from moetool.compute.dtypes import resolve_device, resolve_dtype
    from moetool.compute.stream import streamed_causal_lm
    from moetool.compute.upcast import float32_layer_by_layer

    storage = resolve_dtype("auto", Path(path))
    # the eager expert loop on both sides: a grouped kernel's blocking depends on the expert count
    model: Any
    if streamed:
        model = streamed_causal_lm(Path(path), storage=storage, experts_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=storage, experts_implementation="eager")
        model = float32_layer_by_layer(model.to(resolve_device(device or "auto")).eval())
    handles = []
    try:
        if allowed is not None:
            handles += _restrict(model, allowed)
        if silence_shared:
            handles += _silence_shared(model)
        dev = next(model.parameters()).device
        out: torch.Tensor = model(input_ids=torch.tensor([ids], device=dev), use_cache=False).logits[0].float().cpu()
    finally:
        for h in handles:
            h.remove()
        del model
        gc.collect()
    return out


def probe_ids(path: Path, n_tokens: int = 96) -> list[int]:
    """Token ids of held-out text (the zoo's for a zoo-built model, else a built-in multi-domain sample); for a folder
    without a tokenizer, seeded random ids over its vocabulary (parity needs inputs, not meaning)."""
    from transformers import AutoTokenizer

    from moetool.edit.layout import has_tokenizer
    from moetool.export.heldout import held_out_text
    from moetool.io.checkpoint import Checkpoint

    if not has_tokenizer(path):
        vocab = int(Checkpoint(path).config["vocab_size"])
        return torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    tok = AutoTokenizer.from_pretrained(str(path))
    text, _ = held_out_text(path)
    ids = tok(text, add_special_tokens=False)["input_ids"][: n_tokens - 1]
    return [tok.bos_token_id, *ids] if tok.bos_token_id is not None else ids


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())
