"""``method: comigs``: collaborative learning with a Mixture of Generalists and Specialists (LoRA experts).

Importing this package registers the ``moetool_comigs`` model type with the transformers Auto classes and the
``comigs`` assembler with ``moetool merge``.
"""

from __future__ import annotations

from moetool.methods.comigs.model import ComigsConfig, ComigsForCausalLM, register

register()

__all__ = ["ComigsConfig", "ComigsForCausalLM", "register"]
