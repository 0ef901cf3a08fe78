"""CLI command groups of the methods (``moetool comigs|embedding|gem|hybrid …``).

They live outside ``moetool.methods`` so that ``moetool --help`` and every other command start without importing
torch and the method packages: each command imports its method inside its body.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def friendly(fn: F) -> F:
    """moetool.cli's error handling (one red line, exit code 2), looked up at call time to avoid an import cycle."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from moetool.cli import _friendly

        return _friendly(fn)(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
