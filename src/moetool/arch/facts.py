"""What every model record says, and how llama.cpp holds each architecture (data).

A :class:`ModelFacts` is the part of a record that every consumer reads: the exporters (GGUF, the graph targets,
ONNX's runner config) and the recipe. :class:`moetool.arch.outputs.MoEArch` (output MoE classes) and
:class:`moetool.arch.families.DenseFamily` (dense input families) extend it; ``moetool.arch.records`` indexes them by
``model_type``. No module outside ``moetool.arch`` branches on a model-type string (``tests/arch`` checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# config key → GGUFWriter method, for the scales llama.cpp's granite architectures read (granitemoe requires the
# logit scale; llama.cpp divides the logits by it, as transformers does)
GRANITE_SCALES: tuple[tuple[str, str], ...] = (
    ("embedding_multiplier", "add_embedding_scale"),
    ("residual_multiplier", "add_residual_scale"),
    ("attention_multiplier", "add_attention_scale"),
    ("logits_scaling", "add_logit_scale"),
)


@dataclass(frozen=True, kw_only=True)
class LlamaCppArch:
    """One llama.cpp architecture (``general.architecture``) as moetool writes it.

    Attributes:
        name: llama.cpp's architecture name.
        permute_qk: Q/K rows are reordered from HF's rotate-half to llama.cpp's NORM rope.
        renormalises_topk: its MoE weights the chosen experts by softmax renormalised over the top k (None for a
            dense architecture).
        expert_ff_key: it reads ``expert_feed_forward_length``.
        shared_expert: its loader requires a shared expert in every layer (and ``output.weight``) and reads
            ``expert_shared_feed_forward_length``.
        rope_factors: its loader reads the rope factor tensors (``rope_freqs``, ``rope_factors_*``); the others
            refuse a file that has them (checked in llama-cpp-python 0.3.36's llama.cpp).
        scales: config key → GGUFWriter method for the scales it reads.
    """

    name: str
    permute_qk: bool
    renormalises_topk: bool | None = None
    expert_ff_key: bool = False
    shared_expert: bool = False
    rope_factors: bool = False
    scales: tuple[tuple[str, str], ...] = ()


LLAMA_CPP_ARCHS: dict[str, LlamaCppArch] = {
    a.name: a
    for a in (
        # llama.cpp's 'llama' is also its Mixtral: an MoE whose top-k weights are renormalised
        LlamaCppArch(name="llama", permute_qk=True, renormalises_topk=True, rope_factors=True),
        LlamaCppArch(name="qwen2", permute_qk=False),
        LlamaCppArch(name="qwen3", permute_qk=False),
        LlamaCppArch(
            name="qwen2moe", permute_qk=False, renormalises_topk=False, expert_ff_key=True, shared_expert=True
        ),
        LlamaCppArch(name="qwen3moe", permute_qk=False, renormalises_topk=True, expert_ff_key=True),
        LlamaCppArch(name="granite", permute_qk=True, scales=GRANITE_SCALES),
        LlamaCppArch(name="granitemoe", permute_qk=True, renormalises_topk=True, scales=GRANITE_SCALES),
    )
}

GraphTarget = Literal["onnx", "tflite", "executorch", "coreml"]
GRAPH_TARGETS: tuple[GraphTarget, ...] = ("onnx", "tflite", "executorch", "coreml")


def config_int(cfg: Mapping[str, object], *keys: str) -> int:
    """The first of ``keys`` set in config dict ``cfg`` (a width or count; a numeric string too) as an int.

    0 where none is set (or each is 0).

    Raises:
        TypeError: the value is no number (an array, an object).
    """
    value = next((v for v in map(cfg.get, keys) if v), 0)
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"config {' / '.join(keys)} is {value!r}, not a number")


def config_value(cfg: object, key: str, default: object = None) -> Any:
    """``key`` of a config given as a dict (config.json) or as a transformers config object."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What moetool knows about one Hugging Face ``model_type``, for every stage that reads or writes it.

    Attributes:
        model_type: transformers ``model_type`` (config.json).
        config_class: the transformers config class.
        gguf_arch: the llama.cpp architecture a GGUF of it is written as (a key of ``LLAMA_CPP_ARCHS``).
        gguf_unshared_arch: a llama.cpp architecture that computes the same MoE when it has no shared expert and
            its top-k rule matches (Qwen2-MoE → llama.cpp's Mixtral form); tried before ``gguf_arch``.
        topk: how transformers weights the top-k experts: ``always`` renormalised, or as ``norm_topk_prob`` in the
            config says (``config``); meaningless for a dense model.
        genai_type: onnxruntime-genai's model ``type`` for its ONNX decoder.
        graph_targets: the graph exporters whose export model (``export.graph.model``) computes it.
    """

    model_type: str
    config_class: str
    gguf_arch: str
    gguf_unshared_arch: str | None = None
    topk: Literal["always", "config"] = "always"
    genai_type: str = "llama"
    graph_targets: tuple[GraphTarget, ...] = GRAPH_TARGETS

    @property
    def causal_lm_class(self) -> str:
        """The transformers causal-LM class of ``config_class`` (``Qwen2MoeConfig`` → ``Qwen2MoeForCausalLM``)."""
        return self.config_class.removesuffix("Config") + "ForCausalLM"

    @property
    def gguf(self) -> LlamaCppArch:
        """The llama.cpp architecture of ``gguf_arch``."""
        return LLAMA_CPP_ARCHS[self.gguf_arch]

    @property
    def gguf_unshared(self) -> LlamaCppArch | None:
        """The llama.cpp architecture of ``gguf_unshared_arch``, if any."""
        return LLAMA_CPP_ARCHS[self.gguf_unshared_arch] if self.gguf_unshared_arch else None

    @property
    def has_shared_expert(self) -> bool:
        """Whether the architecture can hold a shared (always-on) expert."""
        return False

    def normalises_topk(self, cfg: object) -> bool:
        """Whether a model of config ``cfg`` (dict or transformers config) renormalises its top-k weights.

        A missing ``norm_topk_prob`` counts as True: every MoE moetool writes sets the key.
        """
        if self.topk == "always":
            return True
        return bool(config_value(cfg, "norm_topk_prob", True))
