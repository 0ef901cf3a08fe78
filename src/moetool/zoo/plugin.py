"""The zoo's source plugin (``zoo:NAME``), registered in :data:`moetool.registry.SOURCES`.

The layers below the zoo (io's model references, train's ``train.data.<d>.zoo``, the exporters' held-out text) reach
the zoo only through this object, looked up by :func:`moetool.io.sources.source_resolver`; none imports the zoo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from moetool.io.sources import SourceResolver
from moetool.zoo.corpora import DOMAINS
from moetool.zoo.store import resolve_zoo_model, zoo_domain_text


class ZooSource:
    """``zoo:NAME``: a model of the built zoo (``moetool zoo build``) and the zoo's domain corpora."""

    scheme = "zoo"
    domains: tuple[str, ...] = DOMAINS

    def resolve(self, name: str) -> Path:
        return resolve_zoo_model(name)

    def domain_text(self, domain: str, split: Literal["train", "valid"]) -> str:
        return zoo_domain_text(domain, split)


SOURCE: SourceResolver = ZooSource()
