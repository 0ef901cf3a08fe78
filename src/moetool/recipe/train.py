"""Recipe sections for router tuning: ``freeze:`` and ``train:``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moetool.recipe.base import RecipeBase, StrictModel


class FreezeSpec(StrictModel):
    """Which parameters train. A parameter trains if it matches a trainable pattern and no frozen one."""

    preset: Literal["mofe", "router_only", "full"] | None = Field(
        default="mofe",
        description="mofe: experts frozen, routers/attention/embeddings/norms train; router_only: routers only.",
    )
    trainable: list[str] = Field(default_factory=list, description="Extra glob patterns over parameter names.")
    frozen: list[str] = Field(default_factory=list, description="Glob patterns that override trainable ones.")


class DataSource(StrictModel):
    """One domain's training text: exactly one of ``zoo``, ``text``, ``jsonl`` or ``hf_dataset``."""

    zoo: str | None = Field(default=None, description="A zoo domain (its train and held-out splits).")
    text: str | None = Field(default=None, description="A local UTF-8 text file.")
    jsonl: str | None = Field(default=None, description="A local JSONL file; ``field`` holds the text.")
    hf_dataset: str | None = Field(default=None, description="A dataset id already in the local HF cache.")
    hf_config: str | None = None
    split: str = "train"
    field: str = "text"

    @model_validator(mode="after")
    def _one(self) -> DataSource:
        given = [k for k in ("zoo", "text", "jsonl", "hf_dataset") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of zoo, text, jsonl, hf_dataset (got {given or 'none'})")
        return self


class TrainSpec(StrictModel):
    """Brief router tuning with experts frozen."""

    data: dict[str, DataSource] = Field(
        default_factory=lambda: {d: DataSource(zoo=d) for d in ("code", "legal", "medical")},
        description="Domain name → its text; batches sample domains equally.",
    )
    steps: int = Field(default=150, ge=1)
    learning_rate: float = Field(default=1e-3, gt=0, allow_inf_nan=False)
    router_learning_rate: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Learning rate of router (gate) weights; None: learning_rate. Routers start from unit-norm "
        "prompt vectors and must grow to route sharply, so they usually want a larger step than the rest.",
    )
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    max_grad_norm: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    batch_size: int = Field(default=8, ge=1)
    seq_len: int = Field(default=128, ge=8)
    # micro-batches of batch_size rows per optimizer step, over all processes: the global batch is
    # batch_size × grad_accum whatever the process count (a multiple of it under accelerate launch)
    grad_accum: int = Field(default=1, ge=1)
    seed: int = 0
    validation_fraction: float = Field(
        default=0.1, gt=0, lt=1, description="Held-out share of documents for sources without their own split."
    )
    checkpoint_every: int = Field(default=50, ge=1, description="Steps between resumable checkpoints.")
    log_every: int = Field(default=10, ge=1)
    load_balancing_coef: float = Field(
        default=0.01, ge=0, allow_inf_nan=False, description="Switch-style balance loss weight."
    )
    z_loss_coef: float = Field(default=0.001, ge=0, allow_inf_nan=False, description="Router z-loss weight.")
    router_jitter: float = Field(default=0.0, ge=0, lt=1, description="Multiplicative noise on router inputs.")


class TuningRecipe(RecipeBase):
    """Router tuning of an existing MoE on its own (no merge): what ``moetool experts`` runs to recalibrate the
    routers after an edit. Built in Python; its ``text`` is its YAML dump."""

    method: Literal["tuning"] = "tuning"
    freeze: FreezeSpec = Field(default_factory=lambda: FreezeSpec(preset="router_only"))
    train: TrainSpec
