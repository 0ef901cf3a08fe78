"""Dense input families: the tensor names moetool reads from a base or expert checkpoint."""

from __future__ import annotations

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# bases ``method: mofe`` merges: the dense families and those only its MoE outputs hold (other methods keep to the first)
MOFE_FAMILIES = (*DENSE_FAMILIES, "granite")
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
    return DENSE_MLP.format(layer=layer, proj=proj)
