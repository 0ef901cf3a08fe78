"""How the consumers of a shared model folder weight an MoE's top-k experts (data, checked by tests/arch).

The folder is read by more than transformers: llama.cpp's own converter (``convert_hf_to_gguf.py``), mlx-lm and
vLLM each have their own class per model type, and where a config key's meaning is optional (Qwen MoE's
``norm_topk_prob``) they do not all read it. A rule is ``always`` (renormalised over the top k), ``never`` (the
softmax over every expert, cut to the top k) or ``config`` (as ``norm_topk_prob`` says, missing = true).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

TopkRule = Literal["always", "never", "config"]


@dataclass(frozen=True)
class Consumer:
    """A runtime that loads the merged folder itself, and its top-k rule per MoE ``model_type``.

    Attributes:
        name: how messages and the card name it.
        checked: the version whose model classes the rules were read from (and, where it runs here, tested).
        topk: ``model_type`` → its rule for that type.
        scales_rope: the model types whose class applies ``rope_scaling``; the others compute the unscaled rope.
    """

    name: str
    checked: str
    topk: Mapping[str, TopkRule]
    scales_rope: frozenset[str]


MLX_LM = Consumer(
    "mlx-lm",
    "0.32.2",
    # models/mixtral.py and granitemoe.py softmax the top-k logits; qwen2_moe.py never renormalises; qwen3_moe.py
    # reads norm_topk_prob
    {"mixtral": "always", "qwen2_moe": "never", "qwen3_moe": "config", "granitemoe": "always"},
    # only granitemoe.py builds its rope with rope_utils.initialize_rope; mixtral.py and qwen3_moe.py build
    # nn.RoPE(base=rope_theta) and ignore rope_scaling, qwen2_moe.py accepts only a linear one (and ignores it)
    frozenset({"granitemoe"}),
)
VLLM = Consumer(
    "vLLM",
    "main, source read 2026-11",
    # FusedMoE(renormalize=True) for Mixtral and GraniteMoE, renormalize=config.norm_topk_prob for the Qwen MoEs
    {"mixtral": "always", "qwen2_moe": "config", "qwen3_moe": "config", "granitemoe": "always"},
    frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "granitemoe"}),  # get_rope(rope_parameters) in every class
)
# llama.cpp's rule follows from the architecture its converter writes (arch.facts.LLAMA_CPP_ARCHS): records.py
OTHER_CONSUMERS: tuple[Consumer, ...] = (MLX_LM, VLLM)


def renormalises(rule: TopkRule, cfg: Mapping[str, object]) -> bool:
    """Whether a consumer with ``rule`` renormalises the top-k weights of a model of config dict ``cfg``."""
    if rule == "config":
        return bool(cfg.get("norm_topk_prob", True))
    return rule == "always"


def differing(cfg: Mapping[str, object], norm: bool) -> list[Consumer]:
    """The consumers (llama.cpp's aside) whose top-k rule for config dict ``cfg`` is not ``norm``."""
    model_type = str(cfg.get("model_type"))
    return [c for c in OTHER_CONSUMERS if model_type in c.topk and renormalises(c.topk[model_type], cfg) != norm]


def rope_scaling_type(cfg: Mapping[str, object]) -> str | None:
    """The scaled rope's type of config dict ``cfg`` (``llama3``, ``yarn``, …), or None for the plain rope."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"
    return None if kind in (None, "default") else str(kind)


def ignoring_rope_scaling(cfg: Mapping[str, object]) -> list[Consumer]:
    """The consumers that load a model of config dict ``cfg`` with its rope unscaled (empty for the plain rope)."""
    model_type = str(cfg.get("model_type"))
    if rope_scaling_type(cfg) is None:
        return []
    return [c for c in OTHER_CONSUMERS if model_type in c.topk and model_type not in c.scales_rope]
