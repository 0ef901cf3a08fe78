"""The CoMiGS model: a frozen dense base whose every MLP becomes a token-routed mixture of LoRA experts.

Expert ``j`` of a layer is the base MLP with expert j's own LoRA on gate/up/down (a whole MLP, not a LoRA delta
mixed after the fact: the activation sits between the LoRA'd linears, so the base MLP does not factor out). Experts
``0 .. n_generalists-1`` are generalists (averaged across users); the rest are specialists (kept on the device).
A bias-free linear router on the MLP input picks ``k = min(2, n)`` experts per token and renormalises their
softmax over the chosen ones (Mixtral's rule, so baking each expert into a dense MLP gives a Mixtral exactly).
With one expert there is no router. Optional attention LoRA is shared by all experts (not routed).

LoRA follows rsLoRA as in the paper (eq. 5): ``W x + γ B (A x)`` with ``γ = α / √r``, A ``[r, in]`` Kaiming-uniform,
B ``[out, r]`` zero, so a fresh model equals its base exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from moetool.io.jsontypes import JsonObject
from moetool.methods.base import DenseMLP, register_causal_lm

MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MODEL_TYPE = "moetool_comigs"


class ComigsConfig(PretrainedConfig):
    """Config of :class:`ComigsForCausalLM`.

    Attributes:
        base_config: the dense base's config as a dict (llama-family: gate/up/down MLP).
        expert_names: one name per expert; the first ``n_generalists`` are generalists.
        n_generalists: how many leading experts are generalists (shared across users).
        routing: ``learned`` (a linear router, top-k = min(2, n)) or ``average`` (no router: the mean of all experts,
            the paper's Local/FedAvg baselines with two LoRA modules).
        lora_rank / lora_alpha: every expert LoRA; scaling α/√r (rsLoRA).
        mlp_targets: which MLP linears carry expert LoRA.
        attn_rank: rank of the shared attention LoRA on ``attn_targets`` (0: none); same α, scaling α/√attn_rank.
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        base_config: JsonObject | None = None,
        expert_names: list[str] | None = None,
        n_generalists: int = 1,
        routing: str = "learned",
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        mlp_targets: list[str] | None = None,
        attn_rank: int = 0,
        attn_targets: list[str] | None = None,
        **kwargs: Any,  # PretrainedConfig's own settings, each with its own type
    ) -> None:
        self.base_config = base_config or {}
        self.expert_names = list(expert_names or ["generalist", "specialist"])
        self.n_generalists = n_generalists
        self.routing = routing
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.mlp_targets = list(mlp_targets or MLP_PROJS)
        self.attn_rank = attn_rank
        self.attn_targets = list(attn_targets or ATTN_PROJS)
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings"):
            if key in self.base_config and key not in kwargs:
                kwargs[key] = self.base_config[key]
        super().__init__(**kwargs)

    @property
    def n_experts(self) -> int:
        return len(self.expert_names)

    @property
    def experts_per_token(self) -> int:
        return min(2, self.n_experts)

    @property
    def has_router(self) -> bool:
        return self.routing == "learned" and self.n_experts > 1

    def dense_config(self) -> PretrainedConfig:
        cfg = dict(self.base_config)
        return AutoConfig.for_model(str(cfg.pop("model_type")), **cfg)


def rs_scaling(alpha: float, rank: int) -> float:
    """rsLoRA scaling γ = α/√r (paper eq. 5)."""
    return alpha / math.sqrt(rank)


def _fresh_lora(rank: int, fan_in: int, fan_out: int) -> tuple[nn.Parameter, nn.Parameter]:
    # kaiming_uniform_(a=√5) as PEFT and nanoGPT-LoRA: U(-1/√in, 1/√in); B = 0 keeps the base exact. Plain tensor
    # ops, not nn.init: transformers turns nn.init into no-ops while it builds models, which would leave garbage
    a = (torch.rand(rank, fan_in) * 2 - 1) / math.sqrt(fan_in)
    return nn.Parameter(a), nn.Parameter(torch.zeros(fan_out, rank))


class LoRAExpert(nn.Module):
    """One expert's LoRA factors: ``<proj>_A [r, in]`` and ``<proj>_B [out, r]`` per MLP target."""

    def __init__(self, base_mlp: DenseMLP, targets: list[str], rank: int) -> None:
        super().__init__()
        for proj in targets:
            lin: nn.Linear = getattr(base_mlp, proj)
            a, b = _fresh_lora(rank, lin.in_features, lin.out_features)
            self.register_parameter(f"{proj}_A", a)
            self.register_parameter(f"{proj}_B", b)


class LoRALinear(nn.Linear):
    """A frozen linear plus one non-routed LoRA (shared attention LoRA); ``weight`` keeps the base's name."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight = base.weight
        self.bias = base.bias
        self.scaling = rs_scaling(alpha, rank)
        self.lora_A, self.lora_B = _fresh_lora(rank, base.in_features, base.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.scaling * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def merged_weight(self) -> torch.Tensor:
        return self.weight + self.scaling * self.lora_B @ self.lora_A


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights of one layer: ``logits [T, n]`` → (weights ``[T, k]``, indices ``[T, k]``).

    Top-k of the raw logits, softmax over the chosen k (equal to Mixtral's softmax → top-k → renormalise). With
    k = n this is the plain softmax over all experts.
    """
    top, idx = logits.topk(top_k, dim=-1)
    return top.float().softmax(dim=-1).to(logits.dtype), idx


class ComigsMoE(nn.Module):
    """Replaces a dense MLP: ``x [B, T, D]`` → ``Σ_{j ∈ topk} w_j · expert_j(x)`` ``[B, T, D]``."""

    def __init__(self, base_mlp: DenseMLP, config: ComigsConfig) -> None:
        super().__init__()
        self.base: DenseMLP = base_mlp  # the dense MLP (frozen gate/up/down_proj and act_fn)
        self.targets = list(config.mlp_targets)
        self.scaling = rs_scaling(config.lora_alpha, config.lora_rank)
        self.top_k = config.experts_per_token
        self.experts = nn.ModuleList(
            LoRAExpert(base_mlp, self.targets, config.lora_rank) for _ in range(config.n_experts)
        )
        hidden = base_mlp.gate_proj.in_features
        self.router = nn.Linear(hidden, config.n_experts, bias=False) if config.has_router else None
        if self.router is not None:
            with (
                torch.no_grad()
            ):  # uniform start (1G1S begins as the plain mean of both experts); not nn.init, see above
                self.router.weight.zero_()
        self.last_logits: torch.Tensor | None = None  # [T, n] of the last forward, for the balance loss

    def _lora(self, x: torch.Tensor, expert: LoRAExpert, proj: str) -> torch.Tensor:
        if proj not in self.targets:
            return torch.zeros((), dtype=x.dtype, device=x.device)
        a = getattr(expert, f"{proj}_A")
        b = getattr(expert, f"{proj}_B")
        return self.scaling * F.linear(F.linear(x, a), b)

    def expert_forward(self, x: torch.Tensor, j: int, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Expert j on ``x [N, D]`` given the base's ``gate(x)`` and ``up(x)`` ``[N, I]`` (shared by all experts)."""
        e = self.experts[j]
        assert isinstance(e, LoRAExpert)
        act = self.base.act_fn
        h = act(gate + self._lora(x, e, "gate_proj")) * (up + self._lora(x, e, "up_proj"))
        result: torch.Tensor = self.base.down_proj(h) + self._lora(h, e, "down_proj")
        return result

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """Dense routing weights ``[N, n]`` (zero for unchosen experts) for ``x [N, D]``."""
        n = len(self.experts)
        if self.router is None:
            self.last_logits = None
            return x.new_full((x.shape[0], n), 1.0 / n)
        logits = self.router(x)  # [N, n]
        self.last_logits = logits
        w, idx = route(logits, self.top_k)
        return torch.zeros_like(logits).scatter(-1, idx, w)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])  # [N, D]
        w = self.weights(x)  # [N, n]
        gate, up = self.base.gate_proj(x), self.base.up_proj(x)
        out = torch.zeros_like(x)
        for j in range(len(self.experts)):
            rows = (w[:, j] != 0).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            y = self.expert_forward(x[rows], j, gate[rows], up[rows])
            out = out.index_add(0, rows, y * w[rows, j, None])
        return out.reshape(shape)


class ComigsForCausalLM(PreTrainedModel, GenerationMixin):
    """A dense causal LM (``self.lm``) with CoMiGS MoE MLPs and optional attention LoRA; keeps the LoRA factors.

    Parameter names: ``lm.model.layers.{i}.mlp.experts.{j}.{proj}_{A|B}`` (expert LoRA),
    ``lm.model.layers.{i}.mlp.router.weight`` ``[n, D]``, ``lm.model.layers.{i}.self_attn.{proj}.lora_{A|B}``.
    """

    config_class = ComigsConfig
    base_model_prefix = "lm"
    _no_split_modules: list[str] = []  # noqa: RUF012  (transformers declares these per instance)
    # applied only when the config says tie_word_embeddings (copied from the base config)
    _tied_weights_keys = {"lm.lm_head.weight": "lm.model.embed_tokens.weight"}  # noqa: RUF012  (transformers declares these per instance)

    def __init__(self, config: ComigsConfig) -> None:
        super().__init__(config)
        dense = config.dense_config()
        self.lm = AutoModelForCausalLM.from_config(dense)
        for layer in self.lm.model.layers:
            layer.mlp = ComigsMoE(layer.mlp, config)
            if config.attn_rank > 0:
                for proj in config.attn_targets:
                    setattr(
                        layer.self_attn,
                        proj,
                        LoRALinear(getattr(layer.self_attn, proj), config.attn_rank, config.lora_alpha),
                    )
        self.post_init()
        # post_init runs the inner model's own _init_weights over its submodules, routers included (llama: normal
        # 0.02); CoMiGS routers start at zero (uniform routing)
        with torch.no_grad():
            for moe in self.moe_layers:
                if moe.router is not None:
                    moe.router.weight.zero_()

    def _init_weights(self, module: nn.Module) -> None:
        # weights come from the base (assemble) or the checkpoint (from_pretrained); nothing to initialise here
        return

    @property
    def moe_layers(self) -> list[ComigsMoE]:
        return [layer.mlp for layer in self.lm.model.layers]

    def get_input_embeddings(self) -> nn.Module:
        result: torch.nn.Module = self.lm.get_input_embeddings()
        return result

    def get_output_embeddings(self) -> nn.Module:
        result: torch.nn.Module = self.lm.get_output_embeddings()
        return result

    def router_logits(self) -> list[torch.Tensor]:
        """``[T, n]`` per layer from the last forward (empty without routers)."""
        return [m.last_logits for m in self.moe_layers if m.last_logits is not None]

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs: object) -> CausalLMOutputWithPast:
        out: CausalLMOutputWithPast = self.lm(input_ids=input_ids, **kwargs)
        return out

    @classmethod
    def from_dense(cls, dense: PreTrainedModel, config: ComigsConfig) -> ComigsForCausalLM:
        """A CoMiGS model over ``dense``'s weights (copied; LoRA fresh: equal to ``dense`` until trained)."""
        model = cls(config)
        state = {}
        for name, t in dense.state_dict().items():
            parts = name.split(".")
            if ".mlp." in name:
                i = parts.index("mlp")
                parts.insert(i + 1, "base")
            state[".".join(parts)] = t
        missing, unexpected = model.lm.load_state_dict(state, strict=False)
        missing = [m for m in missing if not _is_lora_or_router(m)]
        if missing or unexpected:
            raise ValueError(
                f"base weights do not fit the CoMiGS model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        if getattr(dense.config, "tie_word_embeddings", False):
            model.lm.tie_weights()
        return model


def _is_lora_or_router(name: str) -> bool:
    return ".mlp.experts." in name or ".mlp.router." in name or name.endswith((".lora_A", ".lora_B"))


def register() -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load ``model_type: moetool_comigs`` checkpoints."""

    register_causal_lm(ComigsConfig, ComigsForCausalLM)


# importing this module is enough to load its checkpoints through the Auto classes
register()


__all__ = ["ComigsConfig", "ComigsForCausalLM", "ComigsMoE", "LoRALinear", "register", "route"]
