"""``method: comigs``: collaborative learning with a Mixture of Generalists and Specialists (LoRA experts).

``PLUGIN`` is what the pipeline drives; importing :mod:`.model` registers ``moetool_comigs`` with transformers' Auto
classes. This module stays light (no torch), so ``moetool --help`` can list the ``comigs`` sub-commands.
"""

from __future__ import annotations

from moetool.methods.comigs.plugin import ComigsPlugin

PLUGIN = ComigsPlugin()

__all__ = ["PLUGIN", "ComigsPlugin"]
