"""``method: embedding``: context-routed input embeddings (selection, remix, generative) retrofitted onto a causal LM.

Importing the package registers the ``moetool_routed_embedding`` model type with transformers' Auto classes and the
``embedding`` assembler with :mod:`moetool.methods` (which imports this package at its end).
"""

from moetool.methods import register_assembler
from moetool.methods.embedding.assemble import EmbeddingAssembler
from moetool.methods.embedding.model import RoutedEmbeddingConfig, RoutedEmbeddingForCausalLM, register
from moetool.methods.embedding.variants import EmbeddingConfig, RoutedEmbedding, param_counts

register()
register_assembler(EmbeddingAssembler())

__all__ = [
    "EmbeddingAssembler",
    "EmbeddingConfig",
    "RoutedEmbedding",
    "RoutedEmbeddingConfig",
    "RoutedEmbeddingForCausalLM",
    "param_counts",
    "register",
]
