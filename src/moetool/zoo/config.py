"""What determines a zoo build (:class:`ZooConfig`, the named :data:`PROFILES`) and what a build returns."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypedDict

from moetool.errors import MoetoolError
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.train.loop import LoopConfig

ZOO_FORMAT = 1
BASE_NAME = "base"
ZOO_JSON = "zoo.json"
# the real profile: SmolLM2-135M-Instruct and experts continued from it (moetool.zoo.smollm2); its models are
# referenced as zoo:smollm2-NAME
SMOLLM2 = "smollm2"
NAMED_PROFILES: tuple[str, ...] = (SMOLLM2,)


@dataclass(frozen=True)
class ZooConfig(LoopConfig):
    """Everything that determines a zoo build (same config and machine -> same weights): the training loop's
    settings (:class:`~moetool.train.loop.LoopConfig`: seq_len, batch_size, schedule, weight decay, seed) and these."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    base_steps: int = 750
    expert_steps: int = 280
    lr: float = 6e-3
    expert_lr: float | None = None  # None: same as lr
    max_chars_per_domain: int = 3_000_000
    valid_fraction: float = 0.1
    max_valid_chars: int | None = 80_000
    tokenizer_chars_per_domain: int = 400_000  # balanced tokenizer training sample
    expert_trainable: Literal["mlp", "all"] = "mlp"
    tie_word_embeddings: bool = True
    eval_max_tokens: int = 32768
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    # torch threads while building (None: leave torch's setting alone). Results are reproducible for the same
    # seed, config and thread count on the same machine.
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.expert_trainable not in ("mlp", "all"):
            raise MoetoolError(f"expert_trainable must be 'mlp' or 'all', got {self.expert_trainable!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise MoetoolError(
                "hidden_size must be divisible by num_heads, and num_heads by num_kv_heads "
                f"(got {self.hidden_size}, {self.num_heads}, {self.num_kv_heads})"
            )
        if self.seq_len < 8 or self.batch_size < 1 or self.base_steps < 1 or self.expert_steps < 1:
            raise MoetoolError("seq_len, batch_size, base_steps and expert_steps must be positive")

    @classmethod
    def for_profile(cls, profile: str) -> ZooConfig:
        """The config of a named profile (see :data:`PROFILES`)."""
        try:
            return PROFILES[profile]
        except KeyError:
            if profile in NAMED_PROFILES:
                raise MoetoolError(
                    f"zoo profile {profile!r} is a real model, not a toy config: build it with "
                    f"`moetool zoo build --profile {profile}` (moetool.zoo.build_{profile})"
                ) from None
            raise MoetoolError(
                f"unknown zoo profile {profile!r}; known profiles: {', '.join(all_profiles())}"
            ) from None

    def to_dict(self) -> JsonObject:
        """JSON-ready dict of the fields."""
        return dataclasses.asdict(self)


PROFILES: dict[str, ZooConfig] = {
    # The whole zoo (corpora, tokenizer, base, 3 experts, eval) in ~6-8 min on 2 CPU cores.
    "default": ZooConfig(),
    # For tests: seconds, not minutes.
    "tiny": ZooConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seq_len=64,
        batch_size=16,
        base_steps=60,
        expert_steps=40,
        lr=5e-3,
        max_chars_per_domain=60_000,
        valid_fraction=0.15,
        eval_max_tokens=4096,
        num_threads=1,  # matrices this small gain nothing from a second thread
    ),
}


def all_profiles() -> list[str]:
    """Every zoo profile: the toy ones (:data:`PROFILES`) and the real ones (:data:`NAMED_PROFILES`)."""
    return [*sorted(PROFILES), *NAMED_PROFILES]


@dataclass
class ZooResult:
    """What :func:`build_zoo` built (or found already built)."""

    root: Path
    perplexity: dict[str, dict[str, float]]
    seconds: float
    cached: bool = False
    models: list[str] = field(default_factory=list)

    @property
    def matrix(self) -> dict[str, dict[str, float]]:
        """Alias of :attr:`perplexity`: ``matrix[model][domain]``."""
        return self.perplexity


class VocabFields(TypedDict):
    """What a zoo model's config takes from the zoo tokenizer (:func:`vocab_fields`)."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


class ExpertCheck(TypedDict):
    """zoo.json's ``check``: whether every expert beats the base on its own domain's held-out text."""

    passed: bool
    failures: list[str]
    relative_improvement: dict[str, float]


class ZooRecord(TypedDict):
    """What every profile's zoo.json records (:mod:`moetool.zoo.store` reads the models, matrix and check back);
    each profile's record adds its own keys (:class:`ZooMeta`, ``smollm2``'s in :mod:`moetool.zoo.smollm2.matrix`).
    The file's key order is its writer's."""

    profile: str
    built_at: str
    build_seconds: float
    models: list[str]
    domains: list[str]
    perplexity: dict[str, dict[str, float]]
    training: dict[str, dict[str, float]]
    versions: dict[str, str]


class ZooMeta(ZooRecord):
    """What a toy profile's zoo.json records (written by :func:`build_zoo`)."""

    format: int
    config: JsonValue
    seed: int
    check: ExpertCheck
    corpus: dict[str, dict[str, int]]
    corpus_pins: str
    corpus_documents: dict[str, dict[str, str | int]]
    model: dict[str, str | int]
    platform: dict[str, str | int]
