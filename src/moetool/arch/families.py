"""Dense input families as records, and the tensor names moetool reads from a base or expert checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moetool.arch.facts import ModelFacts


@dataclass(frozen=True, kw_only=True)
class DenseFamily(ModelFacts):
    """A dense input family: its facts (``ModelFacts``) and how moetool's methods take it.

    Attributes:
        moe_output: the output MoE architecture native to the family (``architecture: auto`` tries it first).
        mofe_only: only ``method: mofe`` merges it (its only MoE holder is a class the other methods do not write).
        attention_bias: its attention always has q/k/v biases (others have them as ``attention_bias`` says).
    """

    moe_output: str
    mofe_only: bool = False
    attention_bias: bool = False


LLAMA = DenseFamily(
    model_type="llama", config_class="LlamaConfig", gguf_arch="llama", moe_output="mixtral", genai_type="llama"
)
MISTRAL = DenseFamily(
    model_type="mistral", config_class="MistralConfig", gguf_arch="llama", moe_output="mixtral", genai_type="mistral"
)
QWEN2 = DenseFamily(
    model_type="qwen2",
    attention_bias=True,
    config_class="Qwen2Config",
    gguf_arch="qwen2",
    moe_output="qwen2_moe",
    genai_type="qwen2",
)
QWEN3 = DenseFamily(
    model_type="qwen3", config_class="Qwen3Config", gguf_arch="qwen3", moe_output="qwen3_moe", genai_type="qwen3"
)
# the graph export model has no Granite scales, so the graph targets refuse it
GRANITE = DenseFamily(
    model_type="granite",
    mofe_only=True,
    graph_targets=(),
    config_class="GraniteConfig",
    gguf_arch="granite",
    moe_output="granitemoe",
)
FAMILIES: dict[str, DenseFamily] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GRANITE)}

DENSE_FAMILIES = tuple(f.model_type for f in FAMILIES.values() if not f.mofe_only)
# bases ``method: mofe`` merges: the dense families and those only its MoE outputs hold (other methods keep to the first)
MOFE_FAMILIES = tuple(FAMILIES)
# dense families that no standard MoE class computes exactly (an MoE of identical experts would differ from the base)
REFUSED_FAMILIES = {
    "olmo": "OLMoE normalises with weighted RMSNorm and q/k norms; OLMo uses weightless LayerNorm, clip_qkv, no q/k norm",
    "olmo2": "OLMoE is pre-norm (norm, sublayer, add); OLMo 2 is post-norm (sublayer, norm, add)",
    "olmo3": "OLMoE is pre-norm (norm, sublayer, add); OLMo 3 is post-norm (sublayer, norm, add) with sliding windows",
    "phi3": "PhiMoE normalises with LayerNorm (mean removed, bias) where Phi-3 uses RMSNorm, and its sparsemixer "
    "router's top-2 weights do not sum to 1, so no PhiMoE equals a Phi-3 model",
    "gemma": "no standard MoE class has Gemma's (1 + weight) RMSNorm, scaled embeddings and GeGLU",
    "gemma2": "no standard MoE class has Gemma 2's sandwich norms, logit soft-capping and GeGLU",
    "gemma3_text": "no standard MoE class has Gemma 3's sandwich norms, q/k norms and GeGLU",
}
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
DENSE_MLP = "model.layers.{layer}.mlp.{proj}.weight"

# config attributes that must agree between the base and every expert (the foundation)
FOUNDATION_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    # granite's scales (absent, so None on both sides, for the other families)
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)


def dense_mlp_name(layer: int, proj: str) -> str:
    """The dense MLP projection ``proj`` (gate_proj, up_proj, down_proj) of ``layer`` in a base or expert."""
    return DENSE_MLP.format(layer=layer, proj=proj)


# config attributes copied from the dense base when present (None values are skipped)
COMMON_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "attention_dropout",
    "initializer_range",
)

# config keys a dense family keeps beside the common ones (Granite's scales, Qwen3's attention bias)
_DENSE_EXTRA_KEYS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "attention_bias",
)


def dense_config(cfg: Mapping[str, Any], family: str, intermediate: int) -> dict[str, Any]:
    """The config dict of a dense ``family`` model with config dict ``cfg``'s foundation and an ``intermediate`` MLP.

    One expert of an MoE as a model of its own, validated by transformers' config class.
    """
    import transformers

    keys = (*COMMON_CONFIG_KEYS, *_DENSE_EXTRA_KEYS)
    kwargs = {k: cfg[k] for k in keys if cfg.get(k) is not None} | {"intermediate_size": intermediate}
    if family == "mistral" and cfg.get("sliding_window"):
        kwargs["sliding_window"] = cfg["sliding_window"]
    record = FAMILIES[family]
    config = getattr(transformers, record.config_class)(**kwargs)
    config.architectures = [record.causal_lm_class]
    out: dict[str, Any] = config.to_dict()
    return out
