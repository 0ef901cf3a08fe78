"""The expert zoo: small domain experts trained on text already on the machine (``moetool zoo build``)."""

from moetool.zoo.build import build_zoo, quiet_transformers, remove_stale_builds, train_zoo_model, vocab_fields
from moetool.zoo.config import BASE_NAME, PROFILES, ZooConfig, ZooResult
from moetool.zoo.corpora import DOMAINS, DomainSplit, load_domain_documents, make_splits
from moetool.zoo.store import resolve_zoo_model, zoo_domain_text, zoo_models
from moetool.zoo.tokenizer import train_tokenizer

__all__ = [
    "BASE_NAME",
    "DOMAINS",
    "PROFILES",
    "DomainSplit",
    "ZooConfig",
    "ZooResult",
    "build_zoo",
    "load_domain_documents",
    "make_splits",
    "quiet_transformers",
    "remove_stale_builds",
    "resolve_zoo_model",
    "train_tokenizer",
    "train_zoo_model",
    "vocab_fields",
    "zoo_domain_text",
    "zoo_models",
]
