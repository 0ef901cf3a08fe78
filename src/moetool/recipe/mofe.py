"""The ``method: mofe`` recipe: base model + dense experts → a standard MoE checkpoint."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from moetool.arch.outputs import OUTPUT_ARCHS
from moetool.quant.plan import QuantSpec
from moetool.recipe.base import RecipeBase, StrictModel, unique_names
from moetool.recipe.export import TargetSpec, check_target_names
from moetool.recipe.train import FreezeSpec, TrainSpec

ExpertName = str


def _has_text(prompt: str) -> str:
    if not prompt.strip():
        raise ValueError(f"prompt {prompt!r} has no text; a gate needs words to route on")
    return prompt


Prompt = Annotated[str, AfterValidator(_has_text)]

_ARCH_CHOICES = ("auto", *OUTPUT_ARCHS)


def _known_arch(name: str) -> str:
    if name not in _ARCH_CHOICES:
        expected = ", ".join(f"{c!r}" for c in _ARCH_CHOICES[:-1]) + f" or {_ARCH_CHOICES[-1]!r}"
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return name


# the output architectures are the records in moetool.arch.outputs: a new record is a new allowed value
ArchitectureName = Annotated[
    str, AfterValidator(_known_arch), WithJsonSchema({"type": "string", "enum": list(_ARCH_CHOICES)})
]


class ExpertSpec(StrictModel):
    """One routed expert: the MLP of ``source`` becomes expert ``name`` in every layer."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Unique expert name.")
    source: str = Field(description="Local directory, Hugging Face repo id in the local cache, or zoo:NAME.")
    positive_prompts: list[Prompt] = Field(default_factory=list, description="Text this expert should receive.")
    negative_prompts: list[Prompt] = Field(default_factory=list, description="Text this expert should not receive.")


class SharedExpertSpec(StrictModel):
    """An always-on expert (Qwen2-MoE only), e.g. the base FFN as a generalist."""

    source: str
    positive_prompts: list[Prompt] = Field(
        default_factory=list,
        description="If given, the sigmoid shared-expert gate is initialised from these prompts; else it is zero "
        "(a constant 0.5 weight).",
    )
    negative_prompts: list[Prompt] = Field(default_factory=list)


class MoFERecipe(RecipeBase):
    """Mixture of Frozen Experts (MoFE): attention, norms and embeddings from the base, one FFN per expert."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    method: Literal["mofe"]
    base_model: str
    architecture: ArchitectureName = "auto"
    experts_per_token: int = Field(default=2, ge=1)
    gate_mode: Literal["hidden", "cheap_embed", "random"] = "hidden"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    chat_template: bool = Field(
        default=False, description="Wrap prompts in the tokenizer's chat template (as a user turn) for gates."
    )
    norm_topk_prob: bool | None = Field(
        default=None,
        description="Qwen MoE outputs: renormalise the top-k routing weights. Default: what every consumer "
        "computes alike (Qwen3-MoE true; Qwen2-MoE false, as its releases: llama.cpp and mlx-lm never renormalise "
        "it). true on a Qwen2-MoE makes an MoE of identical experts equal the dense model in transformers and vLLM, "
        "and the merge warns that llama.cpp's converter and mlx-lm compute another function.",
    )
    seed: int = Field(default=0, description="Seed for random gates.")
    max_shard_size: int = Field(default=2_000_000_000, ge=1024, description="Output shard size in bytes.")
    experts: list[ExpertSpec] = Field(min_length=1)
    shared_expert: SharedExpertSpec | None = None
    freeze: FreezeSpec = Field(default_factory=FreezeSpec, description="Used by `moetool train`.")
    train: TrainSpec = Field(default_factory=TrainSpec, description="Used by `moetool train`.")
    quantization: QuantSpec | None = Field(
        default=None, description="Precision per tensor for `moetool export` (overridden by --quant)."
    )
    targets: list[TargetSpec] = Field(default_factory=list, description="Artifacts `moetool build` exports.")
    questions: dict[str, Prompt] = Field(
        default_factory=dict,
        description="Label → a question `moetool build` asks the finished MoE through the chat template: the answer "
        "from transformers and from each GGUF in llama.cpp, and the expert shares behind it, go in the report.",
    )

    @model_validator(mode="after")
    def _check(self) -> MoFERecipe:
        unique_names((e.name for e in self.experts), "experts", "expert name")
        if self.experts_per_token > len(self.experts):
            raise ValueError(
                f"experts_per_token: {self.experts_per_token} is larger than the number of experts "
                f"({len(self.experts)})"
            )
        if self.gate_mode != "random":
            for i, e in enumerate(self.experts):
                if not e.positive_prompts:
                    raise ValueError(
                        f"experts.{i}.positive_prompts: expert {e.name!r} has no positive prompts, which "
                        f"gate_mode {self.gate_mode!r} needs (or use gate_mode: random)"
                    )
        check_target_names(self.targets)
        arch = OUTPUT_ARCHS.get(self.architecture)
        if self.norm_topk_prob is False and arch is not None and arch.topk == "always":
            switchable = [a.name for a in OUTPUT_ARCHS.values() if a.topk == "config"]
            raise ValueError(
                f"norm_topk_prob: {arch.name} always renormalises its top-k weights; use {' or '.join(switchable)}"
            )
        if self.shared_expert is not None and arch is not None and not arch.has_shared_expert:
            shared = [a.name for a in OUTPUT_ARCHS.values() if a.has_shared_expert]
            raise ValueError(
                f"shared_expert: only the {', '.join(shared)} architecture has a shared expert, not {arch.name!r}"
            )
        return self
