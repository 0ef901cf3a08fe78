"""The ``method: comigs`` recipe: users with private data share generalist LoRA experts and keep specialists."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moetool.recipe.base import RecipeBase, StrictModel, unique_names
from moetool.recipe.train import DataSource

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
MlpProj = Literal["gate_proj", "up_proj", "down_proj"]
AttnProj = Literal["q_proj", "k_proj", "v_proj", "o_proj"]


def _mlp_projs() -> list[MlpProj]:
    return ["gate_proj", "up_proj", "down_proj"]


def _attn_projs() -> list[AttnProj]:
    return ["q_proj", "k_proj", "v_proj", "o_proj"]


class LoRAExpertSpec(StrictModel):
    """One LoRA expert: fresh (from ``lora``), or started from a PEFT adapter over the base."""

    name: str = Field(pattern=_NAME, description="Unique expert name (across generalists and all specialists).")
    adapter: str | None = Field(
        default=None,
        description="PEFT LoRA adapter directory (relative to the recipe) whose MLP factors start this expert; its "
        "rank must equal lora.rank. None: fresh LoRA (A Kaiming-uniform, B zero).",
    )


class LoRASpec(StrictModel):
    """Shape of every expert LoRA (rsLoRA scaling α/√r, paper eq. 5)."""

    rank: int = Field(default=8, ge=1, description="LoRA rank r (paper: 8).")
    alpha: float = Field(default=16.0, gt=0, description="LoRA α; the scaling is α/√r (paper: 16 → 5.657).")
    targets: list[MlpProj] = Field(
        default_factory=_mlp_projs,
        min_length=1,
        description="MLP linears that carry each expert's LoRA.",
    )
    attention_rank: int = Field(
        default=8, ge=0, description="Rank of the shared, non-routed attention LoRA (0: none). Same α."
    )
    attention_targets: list[AttnProj] = Field(default_factory=_attn_projs, min_length=1)
    share_attention: bool = Field(
        default=True,
        description="Average the attention LoRA across users with the generalists (the reference code does); false "
        "keeps it on the device.",
    )
    seed: int = Field(default=0, description="Seed of fresh LoRA factors and routers.")


class UserSpec(StrictModel):
    """One user (device): its private data and its own specialists."""

    name: str = Field(pattern=_NAME, description="User name; its model is written to <output>/<name>.")
    data: DataSource = Field(description="The user's text: train split (experts) + its held-out split (test).")
    specialists: list[LoRAExpertSpec] = Field(
        default_factory=list, description="This user's specialists (never leave the device); may be empty."
    )
    max_train_tokens: int | None = Field(
        default=None, ge=256, description="Use only this many training tokens (a data-poor user)."
    )
    train_offset: int = Field(
        default=0, ge=0, description="Skip this many training tokens first (two users on one domain, disjoint)."
    )


class ComigsTraining(StrictModel):
    """Bi-level federated training (paper App. B.1.2 defaults)."""

    rounds: int = Field(default=20, ge=1, description="Communication rounds T.")
    local_iterations: int = Field(default=10, ge=1, description="Expert steps per user per round.")
    router_every: int = Field(
        default=30,
        ge=1,
        description="τ: router update every τ expert iterations (counted "
        "in iterations, as the paper's B.1.2 and code, not in rounds).",
    )
    router_steps: int = Field(default=10, ge=0, description="s: router steps per router update.")
    router_split: Literal["valid", "train"] = Field(
        default="valid", description="valid: the bi-level objective; train: the paper's '-tr' ablation."
    )
    batch_size: int = Field(default=64, ge=1)
    seq_len: int = Field(default=128, ge=8)
    expert_lr: float = Field(default=2e-3, gt=0, description="AdamW, cosine to expert_min_lr over all iterations.")
    expert_min_lr: float = Field(default=2e-4, ge=0)
    router_lr: float = Field(default=2e-3, gt=0, description="AdamW, constant.")
    weight_decay: float = Field(default=0.01, ge=0)
    load_balancing: Literal["generalist_favoured", "uniform", "none"] = Field(
        default="generalist_favoured",
        description="generalist_favoured: paper eq. 6 (one generalist; uniform otherwise); uniform: Switch loss.",
    )
    load_balancing_coef: float = Field(default=0.01, ge=0, description="λ in CE + λ·LB (both objectives).")
    valid_fraction: float = Field(
        default=0.1, gt=0, lt=1, description="Tail share of each user's training tokens held out for router steps."
    )
    mimic_reference_gradients: bool = Field(
        default=False,
        description="Reproduce the reference code's gradient leakage (router grads accumulate over expert steps, "
        "validation grads reach the next expert step). Off: the two objectives never share gradients.",
    )
    seed: int = 0


class ComigsRecipe(RecipeBase):
    """CoMiGS: per-layer MoE of LoRA experts; generalists averaged across users, specialists and routers local."""

    name: str = Field(pattern=_NAME)
    method: Literal["comigs"]
    base_model: str = Field(description="Dense llama-family base: directory, HF id in the local cache, or zoo:NAME.")
    lora: LoRASpec = Field(default_factory=LoRASpec)
    generalists: list[LoRAExpertSpec] = Field(
        default_factory=lambda: [LoRAExpertSpec(name="generalist")],
        description="Experts every user shares (averaged each round); CoMiGS uses one.",
    )
    users: list[UserSpec] = Field(min_length=1)
    routing: Literal["learned", "average"] = Field(
        default="learned",
        description="learned: a linear router per layer, top-k = min(2, n); average: no router, the mean of all "
        "experts (the paper's Local / FedAvg baselines).",
    )
    training: ComigsTraining = Field(default_factory=ComigsTraining)

    @model_validator(mode="after")
    def _check(self) -> ComigsRecipe:
        seen = unique_names((g.name for g in self.generalists), "generalists", "expert name")
        unique_names((user.name for user in self.users), "users", "user name")
        for u, user in enumerate(self.users):
            for j, s in enumerate(user.specialists):
                if s.name in seen:
                    raise ValueError(f"users.{u}.specialists.{j}.name: {s.name!r} is also {seen[s.name]}")
                seen[s.name] = f"users.{u}.specialists.{j}"
            if not self.generalists and not user.specialists:
                raise ValueError(f"users.{u}.specialists: user {user.name!r} would have no expert at all")
        return self
