"""``method: embedding``: context-routed input embeddings (selection, remix, generative) retrofitted onto a causal LM.

``PLUGIN`` is what the pipeline drives; importing :mod:`.model` registers ``moetool_routed_embedding`` with
transformers' Auto classes. This module stays light (no torch), so ``moetool --help`` can list its sub-commands.
"""

from moetool.methods.embedding.plugin import EmbeddingPlugin

PLUGIN = EmbeddingPlugin()

__all__ = ["PLUGIN", "EmbeddingPlugin"]
