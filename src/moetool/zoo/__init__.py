"""The expert zoo: small domain experts trained on text already on the machine (``moetool zoo build``)."""

from moetool.zoo.build import (
    PROFILES,
    ZooConfig,
    ZooResult,
    build_zoo,
    resolve_zoo_model,
    zoo_domain_text,
    zoo_models,
)
from moetool.zoo.corpora import DOMAINS, DomainSplit, load_domain_documents, make_splits
from moetool.zoo.tokenizer import train_tokenizer

__all__ = [
    "DOMAINS",
    "PROFILES",
    "DomainSplit",
    "ZooConfig",
    "ZooResult",
    "build_zoo",
    "load_domain_documents",
    "make_splits",
    "resolve_zoo_model",
    "train_tokenizer",
    "zoo_domain_text",
    "zoo_models",
]
