"""The expert zoo: small domain experts trained on text already on the machine (``moetool zoo build``), and the
real profile ``smollm2`` (SmolLM2-135M-Instruct from a PyPI wheel, :mod:`moetool.zoo.smollm2`)."""

from moetool.zoo.build import build_zoo, quiet_transformers, remove_stale_builds, train_zoo_model, vocab_fields
from moetool.zoo.catalog import ZooEntry, zoo_catalog
from moetool.zoo.config import BASE_NAME, NAMED_PROFILES, PROFILES, SMOLLM2, ZooConfig, ZooResult, all_profiles
from moetool.zoo.corpora import DOMAINS, DomainSplit, load_domain_documents, make_splits
from moetool.zoo.smollm2 import Smollm2Result, build_smollm2
from moetool.zoo.store import resolve_zoo_model, split_zoo_name, zoo_domain_text, zoo_models, zoo_ref
from moetool.zoo.tokenizer import train_tokenizer

__all__ = [
    "BASE_NAME",
    "DOMAINS",
    "NAMED_PROFILES",
    "PROFILES",
    "SMOLLM2",
    "DomainSplit",
    "Smollm2Result",
    "ZooConfig",
    "ZooEntry",
    "ZooResult",
    "all_profiles",
    "build_smollm2",
    "build_zoo",
    "load_domain_documents",
    "make_splits",
    "quiet_transformers",
    "remove_stale_builds",
    "resolve_zoo_model",
    "split_zoo_name",
    "train_tokenizer",
    "train_zoo_model",
    "vocab_fields",
    "zoo_catalog",
    "zoo_domain_text",
    "zoo_models",
    "zoo_ref",
]
