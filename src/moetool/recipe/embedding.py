"""The ``method: embedding`` recipe: replace a causal LM's input embedding with a context-routed one."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moetool.recipe.base import RecipeBase, StrictModel
from moetool.recipe.export import TargetSpec, check_target_names
from moetool.recipe.train import DataSource


class RouterSpec(StrictModel):
    """The small causal router (the paper: 2 layers, 8 heads, width 64, 8 queries)."""

    width: int = Field(default=64, ge=4, description="Router width d_r.")
    layers: int = Field(default=2, ge=1, description="Causal self-attention blocks.")
    heads: int = Field(default=8, ge=1, description="Attention heads; must divide width.")
    ff_mult: int = Field(default=2, ge=1, description="MLP width as a multiple of the router width.")
    n_queries: int = Field(default=8, ge=1, description="Learnable queries that cross-attend over the prefix.")


class AuxSpec(StrictModel):
    """Weights of the router's auxiliary losses (selection and remix; the paper's values)."""

    balance: float = Field(default=0.01, ge=0, description="Switch-style load balancing.")
    z: float = Field(default=0.001, ge=0, description="Router z-loss (logsumexp² of the logits).")
    diversity: float = Field(default=0.01, ge=0, description="Mean squared cosine between experts' outputs.")


class EmbeddingSpec(StrictModel):
    """The routed input embedding that replaces the model's table."""

    variant: Literal["generative", "remix", "selection", "dense"] = Field(
        default="generative",
        description="generative: LayerNorm(u + Dropout(R(u, x_<i))); remix: router-weighted row-softmax mixes of "
        "the seed; selection: router-weighted masks over a wide pool table; dense: a factorised table (baseline).",
    )
    seed_dim: int = Field(default=32, ge=3, description="Seed table width d (generative keeps SVD rank d-2).")
    pool_dim: int = Field(default=256, ge=1, description="selection: pool table width (a multiple of seed_dim).")
    mask_hidden: int = Field(default=64, ge=1, description="selection: hidden width of each expert's mask MLP.")
    n_experts: int = Field(default=8, ge=1, description="Experts K (selection, remix).")
    top_k: int = Field(default=8, ge=1, description="Experts mixed per token (K: dense soft routing, the paper's).")
    depth: int = Field(default=0, ge=0, description="dense: causal router blocks on top of the table (0: none).")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="generative: dropout on the generator output.")
    remix_diag: float = Field(default=8.0, description="remix: initial diagonal logit, so S_k starts near I.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The shared causal router.")
    aux: AuxSpec = Field(default_factory=AuxSpec, description="Auxiliary loss weights.")

    def module_kwargs(self) -> dict[str, object]:
        """Keyword arguments of :class:`moetool.methods.embedding.variants.EmbeddingConfig` (less vocab/width)."""
        d = self.model_dump()
        d["router"] = self.router.model_dump()
        d["aux"] = self.aux.model_dump()
        return d


class RetrofitTrainSpec(StrictModel):
    """Training of the new embedding: body frozen, then optionally everything."""

    data: dict[str, DataSource] = Field(
        default_factory=lambda: {d: DataSource(zoo=d) for d in ("code", "legal", "medical")},
        description="Domain name → its text; batches take domains in turn.",
    )
    steps: int = Field(default=200, ge=0, description="Steps with the body (and a kept head) frozen.")
    learning_rate: float = Field(default=3e-3, gt=0)
    batch_size: int = Field(default=8, ge=1)
    seq_len: int = Field(default=64, ge=8)
    warmup_steps: int = Field(default=10, ge=0)
    lm_weight: float = Field(default=1.0, ge=0, description="Weight of the LM loss through the frozen body.")
    distill_weight: float = Field(
        default=1.0, ge=0, description="Weight of ‖h − E[x]‖² / mean ‖E[x]‖² (distillation to the old embedding)."
    )
    unfreeze_steps: int = Field(default=0, ge=0, description="Then this many steps with everything trainable.")
    unfreeze_learning_rate: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    seed: int = 0
    validation_fraction: float = Field(default=0.1, gt=0, lt=1, description="Held-out share for local sources.")

    @model_validator(mode="after")
    def _check(self) -> RetrofitTrainSpec:
        if self.lm_weight == 0 and self.distill_weight == 0 and self.steps:
            raise ValueError("train.lm_weight: lm_weight and distill_weight are both 0; nothing would be trained")
        if not self.data:
            raise ValueError("train.data: give at least one training source")
        return self


class EmbeddingRecipe(RecipeBase):
    """Retrofit a context-routed input embedding onto ``model`` and train it briefly."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Name of the output model.")
    method: Literal["embedding"]
    model: str = Field(description="Causal LM: a local directory, a repo id in the local HF cache, or zoo:NAME.")
    embedding: EmbeddingSpec = Field(default_factory=EmbeddingSpec, description="The routed embedding.")
    head: Literal["keep", "seed"] = Field(
        default="keep",
        description="keep: a separate V×D output head from the original; seed: tied to the seed table through the "
        "projection (no V×D matrix at all).",
    )
    train: RetrofitTrainSpec = Field(default_factory=RetrofitTrainSpec, description="Training after the retrofit.")
    targets: list[TargetSpec] = Field(
        default_factory=list, description="Artifacts `moetool build` exports (onnx, tflite, coreml; float32)."
    )

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRecipe:
        # cross-field checks live here so that each message can name its full field path (the loader's convention)
        e = self.embedding
        if e.top_k > e.n_experts:
            raise ValueError(f"embedding.top_k: {e.top_k} is larger than n_experts ({e.n_experts})")
        if e.variant == "selection" and e.pool_dim % e.seed_dim:
            raise ValueError(f"embedding.pool_dim: {e.pool_dim} is not a multiple of seed_dim {e.seed_dim}")
        if e.router.width % e.router.heads:
            raise ValueError(f"embedding.router.heads: {e.router.heads} does not divide width {e.router.width}")
        if self.head == "seed" and e.variant == "selection":
            raise ValueError("head: 'seed' needs a seed table; the selection variant has a pool table (use keep)")
        check_target_names(self.targets)
        return self
