"""``method: hybrid``: heterogeneous experts (e.g. a Transformer and a Mamba LM) behind a tiny cost-aware router.

See docs/hybrid.md. Modules: experts (one interface, tokenizer check), zoo_mamba (the zoo's Mamba expert), router,
loss, profile (latency profiles), data/pipeline/training (router training on cached expert outputs), assemble
(``moetool merge``), pareto (the λ2 / threshold sweep), export (router artifact, experts, manifest, dispatcher),
plugin (what the pipeline drives), cli (``moetool hybrid …``).
"""

from moetool.methods.hybrid.plugin import HybridPlugin

PLUGIN = HybridPlugin()

__all__ = ["PLUGIN", "HybridPlugin"]
