"""The ``method: hybrid`` recipe: two experts of different architectures behind a tiny cost-aware router."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator

from moetool.recipe.base import ForSection, RecipeBase, StrictModel
from moetool.recipe.export import TargetSpec, check_target_names
from moetool.recipe.train import DataSource

Feature = Literal["length", "domain", "hidden"]


def _all_features() -> list[Feature]:
    return ["length", "domain", "hidden"]


class HybridExpertSpec(StrictModel):
    """One expert: any causal LM transformers can load (a Transformer, ``MambaForCausalLM``, …)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Unique expert name.")
    source: str = Field(description="Local directory, Hugging Face repo id in the local cache, or zoo:NAME.")


class HybridRouterSpec(StrictModel):
    """The router: an MLP over request features; softmax scores; soft mix in training, argmax at inference."""

    features: list[Feature] = Field(
        default_factory=_all_features,
        min_length=1,
        description="length: min(len, max_length)/max_length; domain: one-hot over train.data's domains "
        "(all zero when unknown); hidden: the encoder's mean-pooled hidden state.",
    )
    max_length: int = Field(default=256, ge=2, description="Length that normalises to 1 (longer requests clip).")
    hidden_size: int = Field(default=16, ge=0, description="MLP hidden width; 0 gives one linear layer.")
    encoder: str | None = Field(
        default=None,
        description="Expert whose token embeddings (+ encoder_layers layers) encode 'hidden'; "
        "default: the first expert.",
    )
    encoder_layers: int = Field(default=0, ge=0, description="Decoder layers of the encoder to run (0: embeddings).")
    granularity: Literal["sequence", "token"] = Field(
        default="sequence",
        description="sequence: one expert per request; token: one per token (both experts must then run on "
        "every prefix, so expected latency is the sum of both).",
    )
    utility_head: bool = Field(
        default=False, description="Also regress the costly expert's quality gain (nats/token) from the hidden layer."
    )
    decision: Literal["argmax", "utility"] = Field(
        default="argmax", description="argmax of the scores, or 'costly if predicted gain > utility_threshold'."
    )
    utility_threshold: float = Field(default=0.0, description="tau of the utility rule, in nats per token.")

    @model_validator(mode="after")
    def _check(self) -> HybridRouterSpec:
        if len(set(self.features)) != len(self.features):
            raise ValueError("router.features: a feature is listed twice")
        if self.decision == "utility" and not self.utility_head:
            raise ValueError("router.decision: 'utility' needs router.utility_head: true")
        if self.utility_head and self.hidden_size == 0:
            raise ValueError("router.utility_head: needs router.hidden_size > 0 (it reads the hidden layer)")
        return self


class HybridLossSpec(StrictModel):
    """L = CE + lambda_balance·KL(S‖U) + lambda_penalty·mean max(0, S_costly − threshold) + cost_weight·Σ S_k c_k(L)."""

    lambda_balance: float = Field(default=1.0, ge=0, description="lambda1: weight of the balance term.")
    balance: Literal["kl", "switch", "none"] = Field(
        default="kl",
        description="kl: KL(S‖uniform) per routing unit (the paper's term, sign corrected); switch: batch-level "
        "K·Σ f_k·P_k.",
    )
    lambda_penalty: float = Field(default=0.5, ge=0, description="lambda2: weight of the costly-expert hinge.")
    threshold: float = Field(default=0.08, ge=0, le=1, description="T_u: costly score above which the hinge bites.")
    cost_weight: float = Field(
        default=0.0, ge=0, description="Weight of Σ_k S_k·c_k(L), c_k the latency profile in milliseconds (nats/ms)."
    )
    utility_weight: float = Field(default=1.0, ge=0, description="Weight of the utility head's squared error.")


class HybridTrainSpec(StrictModel):
    """Router-only training: experts frozen, their per-token log-likelihoods computed once and cached."""

    data: dict[str, DataSource] = Field(
        default_factory=lambda: {d: DataSource(zoo=d) for d in ("code", "legal", "medical")},
        min_length=1,
        description="Domain name → its text; domain ids follow this order.",
    )
    min_length: int = Field(default=16, ge=2, description="Shortest request (tokens, BOS included).")
    samples_per_domain: int = Field(default=256, ge=1, description="Training requests per domain.")
    valid_samples_per_domain: int = Field(default=128, ge=1, description="Held-out requests per domain.")
    epochs: int = Field(default=20, ge=1)
    batch_size: int = Field(default=64, ge=1)
    learning_rate: float = Field(default=1e-3, gt=0)
    validation_fraction: float = Field(default=0.1, gt=0, lt=1)
    seed: int = 0


class HybridProfileSpec(ForSection):
    """Where the latency profiles c_k(L) = a·L + b·L² come from."""

    section = "profile"

    for_: str = Field(
        default="this-machine",
        alias="for",
        description="The device the profile describes, recorded with it (as `moetool profile --for`).",
    )
    file: str | None = Field(default=None, description="A profile JSON measured on the device (else measured here).")
    lengths: list[int] = Field(default_factory=lambda: [16, 32, 64, 128, 256], min_length=2)
    repeats: int = Field(default=5, ge=1, description="Timed runs per length (after one warm-up); the fastest counts.")
    threads: int = Field(default=1, ge=1, description="torch / llama.cpp threads while measuring.")
    clock: Literal["cpu", "wall"] = Field(
        default="cpu",
        description="cpu: CPU time of the calling thread (= wall time on an idle core for threads: 1; immune to "
        "other load); wall: perf_counter, for a dedicated device or threads > 1.",
    )


class HybridSweepSpec(StrictModel):
    """The Pareto sweep: one router trained per value."""

    parameter: Literal["lambda_penalty", "threshold", "cost_weight"] = "lambda_penalty"
    values: list[float] = Field(default_factory=lambda: [0.0, 0.25, 0.5, 1.0, 2.0, 4.0], min_length=1)


class HybridRecipe(RecipeBase):
    """Heterogeneous experts (e.g. a Transformer and a Mamba LM) behind a tiny router that picks one per request."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    method: Literal["hybrid"]
    experts: list[HybridExpertSpec] = Field(min_length=2, max_length=2, description="Exactly two experts.")
    costly: str = Field(
        default="auto", description="Name of the costly expert, or auto: the slower one at max_length per profile."
    )
    router: HybridRouterSpec = Field(default_factory=HybridRouterSpec)
    loss: HybridLossSpec = Field(default_factory=HybridLossSpec)
    train: HybridTrainSpec = Field(default_factory=HybridTrainSpec)
    profile: HybridProfileSpec = Field(default_factory=HybridProfileSpec)
    sweep: HybridSweepSpec = Field(default_factory=HybridSweepSpec)
    targets: list[TargetSpec] = Field(
        default_factory=list,
        description="Artifacts `moetool build` exports: router.onnx plus each expert as the target (any target).",
    )

    @model_validator(mode="after")
    def _check(self) -> HybridRecipe:
        names = [e.name for e in self.experts]
        if names[0] == names[1]:
            raise ValueError(f"experts.1.name: duplicate expert name {names[1]!r}")
        if self.costly != "auto" and self.costly not in names:
            raise ValueError(f"costly: {self.costly!r} is not an expert (experts: {', '.join(names)})")
        if self.router.encoder is not None and self.router.encoder not in names:
            raise ValueError(f"router.encoder: {self.router.encoder!r} is not an expert (experts: {', '.join(names)})")
        if self.train.min_length > self.router.max_length:
            raise ValueError(
                f"train.min_length: {self.train.min_length} exceeds router.max_length {self.router.max_length}"
            )
        if max(self.profile.lengths) < self.router.max_length:
            raise ValueError(
                f"profile.lengths: the longest ({max(self.profile.lengths)}) must reach router.max_length "
                f"({self.router.max_length}) so latency is measured, not extrapolated"
            )
        for i, v in enumerate(self.sweep.values):
            problem = sweep_value_problem(self.loss, self.sweep.parameter, v)
            if problem:
                raise ValueError(f"sweep.values.{i}: {v!r} as loss.{self.sweep.parameter}: {problem}")
        check_target_names(self.targets)
        return self


def sweep_value_problem(loss: HybridLossSpec, parameter: str, value: float) -> str | None:
    """Why ``value`` cannot be ``loss.<parameter>``, or None: the sweep sets each value on the loss without the
    loss's own validation (a threshold of 5, a NaN weight), so each is checked here first."""
    try:
        HybridLossSpec.model_validate({**loss.model_dump(), parameter: value})
    except ValidationError as exc:
        return "; ".join(str(e["msg"]) for e in exc.errors())
    return None
