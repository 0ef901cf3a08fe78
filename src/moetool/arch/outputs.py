"""Output MoE architectures: which inputs each accepts, its config, and its tensor names (as templates).

Tensor names are the per-expert ("legacy") layout that transformers 5 loads and fuses on its own, and that
llama.cpp's ``convert_hf_to_gguf.py`` maps (it cannot map the fused ``experts.gate_up_proj`` layout).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from moetool.io.jsontypes import JsonObject, JsonValue

from moetool.arch.facts import ModelFacts, config_int
from moetool.arch.families import COMMON_CONFIG_KEYS, FAMILIES
from moetool.errors import UnsupportedArchitecture


@dataclass(frozen=True)
class Verdict:
    """Whether an output architecture accepts the inputs, and why not."""

    ok: bool
    reason: str = ""


# Qwen2-MoE always has a shared expert, and llama.cpp refuses a zero-width one (for a width of 0 it expects
# intermediate_size). A mixture without one gets the narrowest shared expert that adds exactly nothing: zero
# projections (a zero down_proj outputs 0) and a constant non-zero gate, because llama.cpp computes that gate's sigmoid
# as silu(x)/x, NaN at x = 0; 2**-8 is exact in f16/bf16 and keeps x clear of f16 underflow and overflow.
NULL_SHARED_WIDTH = 1
NULL_SHARED_GATE = 2.0**-8
# config.json marks that shared expert, so exporters can tell it from a real one without reading weights
NULL_SHARED_KEY = "moetool_null_shared_expert"


def shared_expert_width(cfg: Mapping[str, object]) -> int:
    """Width of a config dict's shared expert: 0 without one, and for the null one moetool writes in its place."""
    if cfg.get(NULL_SHARED_KEY):
        return 0
    return config_int(cfg, "shared_expert_intermediate_size")


def expert_count(cfg: Mapping[str, object]) -> int:
    """Routed experts per MoE layer of a config dict; 0 for a dense model.

    ``num_local_experts`` (Mixtral, GraniteMoE) or ``num_experts`` (Qwen MoE).
    """
    return config_int(cfg, "num_local_experts", "num_experts")


# the config key that holds the routed expert count, by architecture family of keys
COUNT_KEYS = ("num_local_experts", "num_experts")


def with_expert_count(cfg: Mapping[str, JsonValue], n_experts: int, top_k: int | None = None) -> JsonObject:
    """A copy of config dict ``cfg`` holding ``n_experts`` routed experts (and ``top_k`` per token when given)."""
    out = dict(cfg)
    key = next((k for k in COUNT_KEYS if k in out), COUNT_KEYS[0])
    out[key] = n_experts
    if top_k is not None:
        out["num_experts_per_tok"] = top_k
    return out


def _common(base: PretrainedConfig) -> dict[str, object]:
    return {k: getattr(base, k) for k in COMMON_CONFIG_KEYS if getattr(base, k, None) is not None}


@dataclass(frozen=True, kw_only=True)
class MoEArch(ModelFacts):
    """An output architecture as data: its facts for every stage and how the merge writes it.

    The facts (``ModelFacts``) are its config class, llama.cpp architecture, top-k rule, onnxruntime-genai type and
    graph targets.

    Its recipe name (``architecture:``) is its ``model_type``, and its transformers causal-LM class the one of its
    config class (:attr:`ModelFacts.causal_lm_class`).

    Attributes:
        accepts: dense base model types it can be built from.
        router: template of the router weight ``[E, H]``.
        expert: template of one expert projection; ``{proj}`` takes ``proj_map`` values.
        proj_map: dense MLP projection name → the name inside an expert.
        shared: template of the shared expert's projections, if the architecture has one.
        shared_gate: template of the shared expert's sigmoid gate ``[1, H]``.
        zero_attn_bias: q/k/v biases the architecture requires and a bias-free base lacks (written as zeros).
        stacked: experts held as one tensor per layer and group ``[E, rows, ...]`` instead of ``expert``'s one per
            expert: (template with ``{layer}``, dense projections concatenated along the rows), e.g. GraniteMoE's
            ``input_linear`` = [gate; up] of every expert.
        count_key: the config key of the routed expert count in the family's released checkpoints, the one
            mlx-lm and llama.cpp's converter read (``arch.released``).
        mlx_switch: mlx-lm's module of a layer's experts stacked ``[E, rows, cols]`` for one dense projection
            (``{layer}``, ``{proj}`` = gate_proj | up_proj | down_proj), which its ``sanitize`` builds from the
            per-expert (or GraniteMoE's stacked) tensors.
    """

    accepts: tuple[str, ...]
    router: str
    expert: str
    proj_map: dict[str, str]
    config_extra: Callable[[PretrainedConfig, int, int, int | None], dict[str, object]]
    shared: str | None = None
    shared_gate: str | None = None
    zero_attn_bias: tuple[str, ...] = ()
    checks: tuple[Callable[[PretrainedConfig], str | None], ...] = field(default=())
    stacked: tuple[tuple[str, tuple[str, ...]], ...] = ()
    count_key: str = "num_local_experts"
    mlx_switch: str = "model.layers.{layer}.block_sparse_moe.switch_mlp.{proj}"

    @property
    def name(self) -> str:
        """The recipe name (``architecture:``): the model type."""
        return self.model_type

    @property
    def class_name(self) -> str:
        """The transformers causal-LM class."""
        return self.causal_lm_class

    def supports(self, base: PretrainedConfig, *, shared: bool) -> Verdict:
        """Explain whether this architecture can hold a MoE built on dense config ``base``."""
        if base.model_type not in self.accepts:
            return Verdict(False, f"accepts {'/'.join(self.accepts)} bases, not {base.model_type!r}")
        if shared and self.shared is None:
            return Verdict(False, "has no shared expert")
        if getattr(base, "mlp_bias", False):
            return Verdict(False, "has no MLP biases (base has mlp_bias: true)")
        for check in self.checks:
            reason = check(base)
            if reason:
                return Verdict(False, reason)
        return Verdict(True)

    def make_config(
        self, base: PretrainedConfig, *, n_experts: int, top_k: int, shared_intermediate: int | None
    ) -> JsonObject:
        """The output config.json as a dict, validated by the transformers config class."""
        import transformers

        kwargs = _common(base) | self.config_extra(base, n_experts, top_k, shared_intermediate)
        cls = getattr(transformers, self.config_class)
        cfg = cls(**kwargs)
        cfg.architectures = [self.class_name]
        out: JsonObject = cfg.to_dict()
        return out

    @property
    def has_shared_expert(self) -> bool:
        """Whether the architecture can hold a shared (always-on) expert."""
        return self.shared is not None

    def router_name(self, layer: int) -> str:
        """The router weight ``[E, H]`` of ``layer``."""
        return self.router.format(layer=layer)

    def expert_name(self, layer: int, expert: int, proj: str) -> str:
        """Dense projection ``proj`` (gate_proj, up_proj, down_proj) of ``expert`` in ``layer``."""
        return self.expert.format(layer=layer, expert=expert, proj=self.proj_map[proj])

    def dense_family(self, cfg: Mapping[str, object]) -> str:
        """The dense family one expert of MoE config dict ``cfg`` is extracted as.

        The family native to this architecture (a Mixtral with a sliding window: mistral).
        """
        if self.name == "mixtral" and cfg.get("sliding_window"):
            return "mistral"
        return next(
            f.model_type for f in FAMILIES.values() if f.moe_output == self.name and f.model_type in self.accepts
        )

    def null_shared(self, layer: int, hidden: int) -> list[tuple[str, tuple[int, ...], float]]:
        """The null shared expert of ``layer`` (see ``NULL_SHARED_WIDTH``) as (tensor name, shape, constant value).

        Projections ``[1, H]``/``[H, 1]`` of zeros and the gate ``[1, H]``; empty for an architecture without one.
        """
        if self.shared is None or self.shared_gate is None:
            return []
        w = NULL_SHARED_WIDTH
        return [
            *((self.shared.format(layer=layer, proj=p), (w, hidden), 0.0) for p in ("gate_proj", "up_proj")),
            (self.shared.format(layer=layer, proj="down_proj"), (hidden, w), 0.0),
            (self.shared_gate.format(layer=layer), (1, hidden), NULL_SHARED_GATE),
        ]


def _no_attn_bias(base: PretrainedConfig) -> str | None:
    if getattr(base, "attention_bias", False):
        return "has no attention biases (base has attention_bias: true)"
    return None


def _mixtral_extra(base: PretrainedConfig, n: int, k: int, _shared: int | None) -> dict[str, object]:
    return {
        "intermediate_size": base.intermediate_size,
        "num_local_experts": n,
        "num_experts_per_tok": k,
        "sliding_window": getattr(base, "sliding_window", None) if base.model_type == "mistral" else None,
        "output_router_logits": False,
    }


def _qwen_moe_extra(base: PretrainedConfig, n: int, k: int, shared: int | None) -> dict[str, object]:
    extra: dict[str, object] = {
        "intermediate_size": base.intermediate_size,
        "moe_intermediate_size": base.intermediate_size,
        "num_experts": n,
        "num_experts_per_tok": k,
        # the top-k rule every consumer computes alike (arch.consumers): Qwen3-MoE's releases renormalise and all
        # honour the key; Qwen2-MoE's do not, and llama.cpp and mlx-lm never renormalise it (so an MoE of identical
        # experts equals the dense model only with `norm_topk_prob: true`, which the merge warns about)
        "norm_topk_prob": base.model_type == "qwen3",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
    }
    if base.model_type == "qwen3":
        extra["attention_bias"] = getattr(base, "attention_bias", False)
    elif shared:
        extra["shared_expert_intermediate_size"] = shared
    else:
        extra |= {"shared_expert_intermediate_size": NULL_SHARED_WIDTH, NULL_SHARED_KEY: True}
    return extra


_QWEN_PROJ = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}

MIXTRAL = MoEArch(
    model_type="mixtral",
    accepts=("llama", "mistral"),
    config_class="MixtralConfig",
    gguf_arch="llama",
    genai_type="mistral",
    router="model.layers.{layer}.block_sparse_moe.gate.weight",
    expert="model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
    proj_map={"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    config_extra=_mixtral_extra,
    checks=(_no_attn_bias,),
)

QWEN3_MOE = MoEArch(
    model_type="qwen3_moe",
    accepts=("qwen3",),
    config_class="Qwen3MoeConfig",
    gguf_arch="qwen3moe",
    topk="config",
    genai_type="qwen3",
    router="model.layers.{layer}.mlp.gate.weight",
    expert="model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
    proj_map=_QWEN_PROJ,
    config_extra=_qwen_moe_extra,
    count_key="num_experts",
    mlx_switch="model.layers.{layer}.mlp.switch_mlp.{proj}",
)

# Qwen2-MoE: Qwen3-MoE's layout, with a shared expert and its gate, and q/k/v biases
QWEN2_MOE = replace(
    QWEN3_MOE,
    model_type="qwen2_moe",
    accepts=("qwen2", "llama", "mistral"),
    config_class="Qwen2MoeConfig",
    gguf_arch="qwen2moe",
    # llama.cpp's qwen2moe never renormalises top-k weights; without a shared expert its Mixtral form computes
    # a renormalised Qwen2-MoE exactly (it takes q/k/v biases)
    gguf_unshared_arch="llama",
    genai_type="qwen2",
    # Qwen2 attention always has q/k/v biases; zeros make a bias-free llama base compute exactly the same
    zero_attn_bias=("q_proj", "k_proj", "v_proj"),
    shared="model.layers.{layer}.mlp.shared_expert.{proj}.weight",
    shared_gate="model.layers.{layer}.mlp.shared_expert_gate.weight",
    checks=(
        _no_attn_bias,
        lambda b: (
            "has no sliding-window mistral variant"
            if b.model_type == "mistral" and getattr(b, "sliding_window", None)
            else None
        ),
    ),
)


def _granite_extra(base: PretrainedConfig, n: int, k: int, _shared: int | None) -> dict[str, object]:
    # GraniteMoE's router softmaxes the top-k logits (renormalised top-k, as Mixtral); the scales carry over
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling", "attention_bias")
    return {
        "intermediate_size": base.intermediate_size,
        "num_local_experts": n,
        "num_experts_per_tok": k,
        "output_router_logits": False,
    } | {key: getattr(base, key) for key in keys if getattr(base, key, None) is not None}


def _granite_head_dim(base: PretrainedConfig) -> str | None:
    head_dim = getattr(base, "head_dim", None)
    if head_dim and head_dim * base.num_attention_heads != base.hidden_size:
        return f"has head_dim = hidden_size / num_attention_heads only (base has head_dim {head_dim})"
    return None


# the graph export model has no Granite scales and no stacked experts: the graph targets refuse it
GRANITEMOE = MoEArch(
    model_type="granitemoe",
    accepts=("granite",),
    config_class="GraniteMoeConfig",
    gguf_arch="granitemoe",
    graph_targets=(),
    router="model.layers.{layer}.block_sparse_moe.router.layer.weight",
    expert="",  # experts are stacked (below): one tensor per layer for [gate; up] and one for down
    proj_map={},
    config_extra=_granite_extra,
    checks=(_granite_head_dim,),
    stacked=(
        ("model.layers.{layer}.block_sparse_moe.input_linear.weight", ("gate_proj", "up_proj")),
        ("model.layers.{layer}.block_sparse_moe.output_linear.weight", ("down_proj",)),
    ),
)

OUTPUT_ARCHS: dict[str, MoEArch] = {a.name: a for a in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, GRANITEMOE)}
# auto selection prefers the architecture native to the base family
_PREFERRED = {f.model_type: f.moe_output for f in FAMILIES.values()}


def output_arch(model_type: object) -> MoEArch | None:
    """The output architecture record of a config's ``model_type``, or None for one moetool does not write."""
    return next((a for a in OUTPUT_ARCHS.values() if a.model_type == model_type), None)


def select_output_arch(requested: str, base: PretrainedConfig, *, shared: bool) -> MoEArch:
    """Pick the output architecture for dense config ``base``.

    Raises:
        UnsupportedArchitecture: listing every architecture and why it was rejected.
    """
    if requested != "auto":
        arch = OUTPUT_ARCHS[requested]
        verdict = arch.supports(base, shared=shared)
        if not verdict.ok:
            raise UnsupportedArchitecture(f"architecture: {requested} {verdict.reason}")
        return arch
    order = [_PREFERRED.get(base.model_type, "")] if not shared else []
    order += [n for n in OUTPUT_ARCHS if n not in order]
    verdicts = {}
    for name in order:
        if name not in OUTPUT_ARCHS:
            continue
        verdict = OUTPUT_ARCHS[name].supports(base, shared=shared)
        if verdict.ok:
            return OUTPUT_ARCHS[name]
        verdicts[name] = verdict.reason
    lines = "\n".join(f"  - {n}: {r}" for n, r in verdicts.items())
    raise UnsupportedArchitecture(
        f"no output architecture accepts a {base.model_type!r} base"
        f"{' with a shared expert' if shared else ''}:\n{lines}\n"
        f"supported dense bases: {supported_bases()}"
    )


def supported_bases() -> str:
    """The dense families each output architecture accepts, e.g. ``llama (→ mixtral, qwen2_moe), …``."""
    parts = []
    for family in FAMILIES:
        outs = [a.name for a in OUTPUT_ARCHS.values() if family in a.accepts]
        parts.append(f"{family} (→ {', '.join(outs)})")
    return ", ".join(parts)
