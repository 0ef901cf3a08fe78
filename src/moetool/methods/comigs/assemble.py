"""``method: comigs`` assembly: a dense base + LoRA experts → one CoMiGS model per user (untrained or trained).

Every user's model holds the recipe's generalists (experts ``0 .. G-1``) followed by its own specialists. Fresh
LoRA factors are seeded by expert name, so a generalist starts identical on every device (the server's
initialisation) while specialists differ; PEFT adapters start an expert from trained factors, their PEFT scaling
folded into B so the CoMiGS rsLoRA scaling reproduces them exactly.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moetool.arch.families import DENSE_FAMILIES
from moetool.errors import MoetoolError, PreflightError
from moetool.export.gguf.lora import module_scaling, read_adapter
from moetool.io.sources import resolve_source
from moetool.methods.comigs.model import ComigsConfig, ComigsForCausalLM, LoRAExpert, LoRALinear, rs_scaling
from moetool.recipe.comigs import ComigsRecipe, LoRAExpertSpec, UserSpec

PARITY_TOL = 1e-5


def resolve_base(recipe: ComigsRecipe, recipe_dir: Path | None) -> Path:

    try:
        return resolve_source(recipe.base_model, relative_to=recipe_dir).path
    except MoetoolError as exc:
        raise PreflightError(f"base_model: {exc}") from None


def base_config(recipe: ComigsRecipe, recipe_dir: Path | None) -> PretrainedConfig:
    """The dense base's config, checked to be a llama-family decoder with a bias-free gate/up/down MLP."""
    path = resolve_base(recipe, recipe_dir)
    try:
        cfg: PretrainedConfig = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise PreflightError(f"base_model: cannot read config of {path}: {exc}") from None
    if cfg.model_type not in DENSE_FAMILIES:
        raise PreflightError(
            f"base_model: {cfg.model_type!r} is not a supported dense family (supported: {', '.join(DENSE_FAMILIES)})"
        )
    if getattr(cfg, "mlp_bias", False):
        raise PreflightError("base_model: MLP biases are not supported (LoRA experts need a bias-free MLP)")
    return cfg


def user_experts(recipe: ComigsRecipe, user: UserSpec) -> list[LoRAExpertSpec]:
    return [*recipe.generalists, *user.specialists]


def user_config(recipe: ComigsRecipe, user: UserSpec, base_cfg: PretrainedConfig) -> ComigsConfig:
    lora = recipe.lora
    return ComigsConfig(
        base_config=base_cfg.to_dict(),
        expert_names=[e.name for e in user_experts(recipe, user)],
        n_generalists=len(recipe.generalists),
        routing=recipe.routing,
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        mlp_targets=list(lora.targets),
        attn_rank=lora.attention_rank,
        attn_targets=list(lora.attention_targets),
        architectures=["ComigsForCausalLM"],
    )


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _kaiming_(t: torch.Tensor, g: torch.Generator) -> None:
    bound = 1.0 / t.shape[1] ** 0.5  # kaiming_uniform_(a=√5) on [r, in]: U(-1/√in, 1/√in)
    with torch.no_grad():
        t.copy_(torch.rand(t.shape, generator=g) * 2 * bound - bound)


def _load_adapter(
    expert: LoRAExpert,
    layer: int,
    spec: LoRAExpertSpec,
    where: str,
    recipe_dir: Path | None,
    rank: int,
    scaling: float,
    targets: list[str],
) -> None:

    path = Path(spec.adapter or "")
    if recipe_dir is not None and not path.is_absolute() and (recipe_dir / path).is_dir():
        path = recipe_dir / path
    if not (path / "adapter_config.json").is_file():
        raise PreflightError(f"{where}.adapter: {path} is not a PEFT adapter directory (no adapter_config.json)")
    cfg, pairs = read_adapter(path)
    for proj in targets:
        name = f"model.layers.{layer}.mlp.{proj}.weight"
        if name not in pairs:
            raise PreflightError(f"{where}.adapter: {path} has no LoRA on {name} (lora.targets asks for it)")
        a, b = pairs[name]
        if a.shape[0] != rank:
            raise PreflightError(f"{where}.adapter: {name} has rank {a.shape[0]}, lora.rank is {rank}")
        s = module_scaling(cfg, name, rank)
        with torch.no_grad():
            getattr(expert, f"{proj}_A").copy_(a)
            getattr(expert, f"{proj}_B").copy_(b * (s / scaling))  # fold PEFT's scaling: γ·B' A = s·B A


def build_user_model(
    recipe: ComigsRecipe, user: UserSpec, dense: PreTrainedModel, recipe_dir: Path | None = None
) -> ComigsForCausalLM:
    """The user's CoMiGS model over the loaded dense base (weights copied, LoRA seeded by expert name)."""
    cfg = user_config(recipe, user, dense.config)
    model = ComigsForCausalLM.from_dense(dense, cfg)
    lora = recipe.lora
    scaling = rs_scaling(lora.alpha, lora.rank)
    specs = user_experts(recipe, user)
    where = {e.name: f"generalists.{i}" for i, e in enumerate(recipe.generalists)}
    u = recipe.users.index(user)
    where |= {e.name: f"users.{u}.specialists.{i}" for i, e in enumerate(user.specialists)}
    for li, moe in enumerate(model.moe_layers):
        for j, spec in enumerate(specs):
            expert = moe.experts[j]
            assert isinstance(expert, LoRAExpert)
            if spec.adapter is not None:
                _load_adapter(expert, li, spec, where[spec.name], recipe_dir, lora.rank, scaling, list(lora.targets))
                continue
            g = _generator(lora.seed, f"{spec.name}/{li}")
            for proj in lora.targets:
                _kaiming_(getattr(expert, f"{proj}_A"), g)
        attn = model.lm.model.layers[li].self_attn
        for attn_proj in lora.attention_targets if lora.attention_rank else []:
            lin = getattr(attn, attn_proj)
            assert isinstance(lin, LoRALinear)
            _kaiming_(lin.lora_A, _generator(lora.seed, f"attention/{li}/{attn_proj}"))
    return model


def shared_names(model: ComigsForCausalLM, recipe: ComigsRecipe) -> list[str]:
    """Parameter names that leave the device: generalist LoRA, plus attention LoRA when shared. Nothing without
    generalists (Local, 2S: no communication)."""
    n_gen = len(recipe.generalists)
    if n_gen == 0:
        return []
    out = []
    for name, _ in model.named_parameters():
        if (".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) < n_gen) or (
            recipe.lora.share_attention and ".self_attn." in name and name.endswith((".lora_A", ".lora_B"))
        ):
            out.append(name)
    return out


def load_dense(recipe: ComigsRecipe, recipe_dir: Path | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path]:
    """(dense base in float32, its tokenizer, its path)."""
    from transformers import AutoTokenizer

    base_config(recipe, recipe_dir)
    path = resolve_base(recipe, recipe_dir)
    dense: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path))
    return dense, tok, path


class UserCounts(TypedDict):
    """One user's model: its experts, routed top-k, router parameters and the parameters one upload carries."""

    experts: int
    top_k: int
    router: int
    upload: int


class ParamCounts(TypedDict):
    """Parameters per LoRA expert and per attention LoRA, and each user's :class:`UserCounts`."""

    expert_lora: int
    attention_lora: int
    users: dict[str, UserCounts]


def count_params(recipe: ComigsRecipe, base_cfg: PretrainedConfig) -> ParamCounts:
    """Per user: experts, router and LoRA parameter counts, and what one upload carries (no weights read)."""
    d, inter, layers = base_cfg.hidden_size, base_cfg.intermediate_size, base_cfg.num_hidden_layers
    r = recipe.lora.rank
    per_proj = {"gate_proj": r * (d + inter), "up_proj": r * (d + inter), "down_proj": r * (inter + d)}
    expert = layers * sum(per_proj[p] for p in recipe.lora.targets)
    heads = base_cfg.num_attention_heads
    head_dim = getattr(base_cfg, "head_dim", None) or d // heads
    kv = getattr(base_cfg, "num_key_value_heads", heads) * head_dim
    attn_shape = {
        "q_proj": (d, heads * head_dim),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (heads * head_dim, d),
    }
    ar = recipe.lora.attention_rank
    attn = layers * sum(ar * (i + o) for p, (i, o) in attn_shape.items() if p in recipe.lora.attention_targets)
    out: ParamCounts = {"expert_lora": expert, "attention_lora": attn, "users": {}}
    for user in recipe.users:
        n = len(recipe.generalists) + len(user.specialists)
        router = layers * d * n if recipe.routing == "learned" and n > 1 else 0
        upload = len(recipe.generalists) * expert + (attn if recipe.generalists and recipe.lora.share_attention else 0)
        out["users"][user.name] = {"experts": n, "top_k": min(2, n), "router": router, "upload": upload}
    return out
