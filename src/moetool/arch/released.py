"""Config dicts in the form the families' own releases use, so every consumer reads the model moetool wrote.

transformers 5 serialises the rope base only inside ``rope_parameters`` and a Qwen3-MoE's expert count as
``num_local_experts``. The released checkpoints (Mixtral-8x7B, Qwen1.5-MoE, Qwen3-30B-A3B, granite-3.0-3b-a800m,
Llama 3.2) carry ``rope_theta`` (and ``rope_scaling`` where the rope is scaled) at the top level and ``num_experts``
for the Qwen MoEs, and that is what the other consumers read: mlx-lm defaults a missing ``rope_theta`` to 1e6 (a
model with another rope, silently) and refuses a Qwen3-MoE or GraniteMoE without it; llama.cpp's converter and
vLLM read the same keys. transformers 5 loads both forms alike, so writing both costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from moetool.arch.outputs import COUNT_KEYS, expert_count, output_arch

if TYPE_CHECKING:
    from moetool.io.jsontypes import JsonObject, JsonValue


def released_config(cfg: Mapping[str, JsonValue]) -> JsonObject:
    """A copy of config dict ``cfg`` with the keys the family's released checkpoints carry.

    Beside transformers 5's ``rope_parameters``: top-level ``rope_theta``, and ``rope_scaling`` (the parameters
    without the base) where the rope type is not ``default``; an MoE's routed expert count under its family's key
    (``MoEArch.count_key``) only. Idempotent; a config without ``rope_parameters`` keeps its rope keys as they are.
    """
    out = dict(cfg)
    rope = out.get("rope_parameters")
    if isinstance(rope, Mapping) and rope.get("rope_theta") is not None:
        out["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            out["rope_scaling"] = scaling
        else:
            out.pop("rope_scaling", None)
    arch = output_arch(out.get("model_type"))
    n = expert_count(out)
    if arch is not None and n:
        for key in COUNT_KEYS:
            out.pop(key, None)
        out[arch.count_key] = n
    return out
