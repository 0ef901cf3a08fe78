"""Dense input families: the tensor names moetool reads from a base or expert checkpoint."""

from __future__ import annotations

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
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
)


def dense_mlp_name(layer: int, proj: str) -> str:
    return DENSE_MLP.format(layer=layer, proj=proj)
