"""``method: gem``: domain pathways behind a confidence-threshold router with a general fallback (arXiv 2503.22698).

``PLUGIN`` is what the pipeline drives; importing :mod:`.model` registers ``moetool_gem`` with transformers' Auto
classes. This module stays light (no torch), so ``moetool --help`` can list the ``gem`` sub-commands.
"""

from moetool.methods.gem.plugin import GemPlugin

PLUGIN = GemPlugin()

__all__ = ["PLUGIN", "GemPlugin"]
