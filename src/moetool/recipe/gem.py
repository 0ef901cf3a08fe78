"""The ``method: gem`` recipe: a general model + domain experts of one foundation behind a confidence-threshold router.

GEM (arXiv 2503.22698): P(d|x) = softmax(W_r · e(x)); the argmax domain's pathway if max P > tau, else the general one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moetool.quant.devices import get_device
from moetool.quant.plan import QuantSpec
from moetool.recipe.base import RecipeBase, StrictModel
from moetool.recipe.export import TargetSpec, check_target_names
from moetool.recipe.train import DataSource

QATGroup = Literal["pathways", "general_ffn", "attention"]
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class GemDomain(StrictModel):
    """One domain pathway: the expert that serves it and the labelled text its router learns it from."""

    name: str = Field(pattern=_NAME, description="Domain name (also the pathway name); 'general' is reserved.")
    source: str = Field(description="The domain expert: local directory, HF repo id in the local cache, or zoo:NAME.")
    data: DataSource = Field(description="Domain-labelled text for router training (and QAT).")


class GemRouterSpec(StrictModel):
    """The router: encoder, threshold rule and its training (experts frozen; only W_r and its bias train)."""

    encoder: Literal["base"] = Field(
        default="base",
        description="base: the general model's own hidden states after its first `encoder_layers` layers.",
    )
    encoder_layers: int = Field(
        default=1, ge=0, description="Layers of the general model the encoder runs (0: embeddings)."
    )
    context: Literal["token", "prefix"] = Field(
        default="token",
        description="token: e(x_t) of each token alone (the paper); prefix: the running mean of e over tokens ≤ t "
        "(causal), so a token is routed by its document so far.",
    )
    tau: float = Field(default=0.7, ge=0, le=1, description="Strict threshold: a domain is chosen only if max P > tau.")
    steps: int = Field(default=200, ge=0, description="Router training steps (0: leave W_r at zero, all general).")
    learning_rate: float = Field(default=0.01, gt=0)
    batch_size: int = Field(default=8, ge=1)
    seq_len: int = Field(default=128, ge=8)
    seed: int = 0
    tau_grid: list[float] = Field(
        default_factory=lambda: [0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95],
        description="Thresholds at which the held-out accuracy / fallback table is reported.",
    )
    eval_tokens: int = Field(default=8192, ge=64, description="Held-out tokens per domain for the router report.")


class GemQATSpec(StrictModel):
    """Quantization-aware tuning: L = L_task + lambda_q·Σ‖W − Q(W)‖² + lambda_kd·L_kd (Q from the hybrid plan)."""

    steps: int = Field(default=0, ge=0, description="0 disables QAT.")
    lambda_q: float = Field(default=0.1, ge=0, description="Weight of the quantization penalty (paper: 0.1).")
    lambda_kd: float = Field(default=0.5, ge=0, description="Weight of distillation from the domain's expert (0.5).")
    temperature: float = Field(default=2.0, gt=0, description="KD temperature T (the paper gives none; our default).")
    learning_rate: float = Field(default=1e-4, gt=0)
    batch_size: int = Field(default=4, ge=1)
    seq_len: int = Field(default=128, ge=8)
    trainable: list[QATGroup] = Field(
        default_factory=lambda: list[QATGroup](["pathways"]),
        description="What trains; everything else (router, embeddings, norms) stays bit-identical.",
    )
    seed: int = 0


class GemScarSpec(StrictModel):
    """SCAR: attention restricted to tokens of the same cosine k-means cluster (additive −inf mask, causal)."""

    clusters: int = Field(default=0, ge=0, description="k (paper: 16); 0 disables SCAR.")
    iterations: int = Field(default=10, ge=1, description="k-means iterations when fitting centroids.")
    calibration_tokens: int = Field(default=4096, ge=64, description="Tokens per domain the centroids are fitted on.")


class GemRecipe(RecipeBase):
    """GEM: a general pathway plus one pathway per domain, chosen per token (FFNs) or per sequence (whole models)."""

    name: str = Field(pattern=_NAME)
    method: Literal["gem"]
    general: str = Field(description="The general model (the experts' foundation): directory, HF id or zoo:base.")
    level: Literal["token", "sequence"] = Field(
        default="token",
        description="token: each pathway is a domain expert's FFN inside the general model (one moetool_gem "
        "checkpoint); sequence: each pathway is a whole expert model, chosen once per input.",
    )
    domains: list[GemDomain] = Field(min_length=1)
    router: GemRouterSpec = Field(default_factory=GemRouterSpec)
    qat: GemQATSpec = Field(default_factory=GemQATSpec)
    scar: GemScarSpec = Field(default_factory=GemScarSpec)
    quantization: QuantSpec = Field(
        default_factory=lambda: QuantSpec(preset="gem"),
        description="Hybrid precision by role (default: the gem preset, pathways 4-bit, router 6-bit, rest 8-bit).",
    )
    devices: list[str] = Field(
        default_factory=lambda: ["raspberry-pi-4", "pixel-6", "iphone-13"],
        description="Device profiles the memory estimate is printed for before anything is written.",
    )
    targets: list[TargetSpec] = Field(
        default_factory=list,
        description="Artifacts `moetool build` exports (token level: onnx, tflite; sequence level: any target).",
    )

    @model_validator(mode="after")
    def _check(self) -> GemRecipe:
        seen: dict[str, int] = {}
        for i, d in enumerate(self.domains):
            if d.name == "general":
                raise ValueError(f"domains.{i}.name: 'general' is the fallback pathway's name; pick another")
            if d.name in seen:
                raise ValueError(f"domains.{i}.name: duplicate domain {d.name!r} (also domains.{seen[d.name]})")
            seen[d.name] = i

        for i, dev in enumerate(self.devices):
            try:
                get_device(dev)
            except ValueError as exc:
                raise ValueError(f"devices.{i}: {exc}") from None
        if self.level == "sequence" and self.scar.clusters:
            raise ValueError(
                "scar.clusters: SCAR is part of the token-level model; sequence-level pathways are "
                "the experts unchanged"
            )
        if self.level == "sequence" and self.qat.steps:
            raise ValueError("qat.steps: QAT tunes the token-level model's pathways; use level: token")
        check_target_names(self.targets)
        return self
