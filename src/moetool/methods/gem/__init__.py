"""``method: gem``: domain pathways behind a confidence-threshold router with a general fallback (arXiv 2503.22698).

Importing this package registers the ``moetool_gem`` model class with transformers' Auto classes.
"""

from moetool.methods import register_assembler
from moetool.methods.gem.assembler import GemAssembler
from moetool.methods.gem.model import GemConfig, GemForCausalLM, register

register()
register_assembler(GemAssembler())

__all__ = ["GemAssembler", "GemConfig", "GemForCausalLM", "register"]
