"""Re-export: recipe models share :class:`moetool.strict.StrictModel` (defined outside this package so that
modules the recipes use, such as ``moetool.quant.plan``, can import it without importing the recipe loader)."""

from moetool.strict import StrictModel

__all__ = ["StrictModel"]
