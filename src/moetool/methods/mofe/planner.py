"""``method: mofe``: base attention/norms/embeddings + one FFN per expert → Mixtral / Qwen2-MoE / Qwen3-MoE.

Preflight reads configs, tensor headers and tokenizers only; nothing is written until every check passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

import re
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from moetool.arch.families import FOUNDATION_KEYS, MLP_PROJS, MOFE_FAMILIES, REFUSED_FAMILIES, dense_mlp_name
from moetool.arch.outputs import MoEArch, select_output_arch
from moetool.arch.records import consumer_caveats
from moetool.errors import MoetoolError, PreflightError
from moetool.io.checkpoint import Checkpoint
from moetool.io.files import tokenizer_signature
from moetool.io.safe import read_json
from moetool.io.sources import ResolvedSource, resolve_sources
from moetool.methods.mofe.checks import check_prompts, load_tokenizer
from moetool.methods.mofe.plan import MergePlan, TensorOp
from moetool.recipe.mofe import MoFERecipe

# non-MLP tensors of a dense base that are copied unchanged; anything else in the base is an error
_COPIED = [
    re.compile(p)
    for p in (
        r"model\.embed_tokens\.weight",
        r"model\.norm\.weight",
        r"lm_head\.weight",
        r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
        r"model\.layers\.\d+\.self_attn\.[qkvo]_proj\.(weight|bias)",
        r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight",
    )
]
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")  # non-persistent buffers some old checkpoints saved
_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _refs(recipe: MoFERecipe) -> dict[str, tuple[str, str]]:
    """label -> (recipe field, model reference) for every checkpoint the recipe names."""
    refs: dict[str, tuple[str, str]] = {"base": ("base_model", recipe.base_model)}
    for i, e in enumerate(recipe.experts):
        refs[e.name] = (f"experts.{i}.source", e.source)
    if recipe.shared_expert is not None:
        refs["shared"] = ("shared_expert.source", recipe.shared_expert.source)
    return refs


def _base_config(path: Path) -> Any:
    read_json(path / "config.json", what="model config")  # a malformed one is named before transformers reads it
    try:
        base_cfg = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise PreflightError(f"base_model: cannot read config of {path}: {exc}") from None
    if base_cfg.model_type not in MOFE_FAMILIES:
        supported = ", ".join(MOFE_FAMILIES)
        why = REFUSED_FAMILIES.get(base_cfg.model_type)
        raise PreflightError(
            f"base_model: {base_cfg.model_type!r} is not a supported dense family (supported: {supported})"
            f"{f': no standard MoE class equals it ({why})' if why else ''}"
        )
    return base_cfg


def _base_tensors(ck: Checkpoint, arch: MoEArch, problems: list[str]) -> dict[str, Any]:
    """The base's tensors; any that has no place in the output is a problem."""
    base_t: dict[str, Any] = {}
    try:
        base_t = ck.tensors
    except MoetoolError as exc:
        problems.append(f"base_model: {exc}")
    for name in base_t:
        if _MLP.match(name) or _IGNORED.fullmatch(name) or any(p.fullmatch(name) for p in _COPIED):
            continue
        problems.append(f"base_model: tensor {name!r} has no place in a {arch.name} checkpoint")
    return base_t


def _check_expert(
    fieldname: str,
    ck: Checkpoint,
    base_cfg: PretrainedConfig,
    mlp_shapes: dict[str, Any],
    base_sig: tuple[Any, ...] | None,
    *,
    shared: bool,
    problems: list[str],
    warnings: list[str],
) -> None:
    """Foundation keys, MLP tensor names and shapes, and the tokenizer of one expert against the base."""
    try:
        cfg = ck.config
        tensors = ck.tensors
    except MoetoolError as exc:
        problems.append(f"{fieldname}: {exc}")
        return
    for key in FOUNDATION_KEYS:
        if cfg.get(key) != getattr(base_cfg, key, None):
            problems.append(
                f"{fieldname}: {key} is {cfg.get(key)!r} but the base has {getattr(base_cfg, key, None)!r} "
                "(experts must share the base's foundation)"
            )
    for layer in range(base_cfg.num_hidden_layers):
        for proj in MLP_PROJS:
            name = dense_mlp_name(layer, proj)
            info = tensors.get(name)
            if info is None:
                problems.append(f"{fieldname}: missing tensor {name!r}")
            elif not shared and info.shape != mlp_shapes.get(name):
                problems.append(
                    f"{fieldname}: {name} has shape {list(info.shape)}, base has {list(mlp_shapes.get(name, ()))}"
                )
    sig = tokenizer_signature(load_tokenizer(ck.path))
    if sig is None:
        warnings.append(f"{fieldname}: {ck.path} has no tokenizer; vocabulary match not checked")
    elif base_sig is not None and sig != base_sig:
        problems.append(
            f"{fieldname}: its tokenizer differs from the base's (vocabulary or special tokens); experts "
            "must share one tokenizer"
        )


def _mixture_warnings(recipe: MoFERecipe, sources: dict[str, ResolvedSource]) -> list[str]:
    warnings = []
    n_exp = len(recipe.experts)
    if n_exp < 2:
        warnings.append(
            "experts: 1 expert; a one-expert mixture computes exactly that expert's FFN behind a router with nothing "
            "to choose (use the expert directly, or add at least 2)"
        )
    if n_exp & (n_exp - 1):
        warnings.append(
            f"{n_exp} experts is not a power of two; some inference stacks (older llama.cpp builds, fused "
            "kernels) handle such counts badly or slowly"
        )
    srcs = [sources[e.name].path for e in recipe.experts]
    if len(set(srcs)) < len(srcs):
        warnings.append("several experts come from the same checkpoint; they will be identical")
    return warnings


def plan_mofe(recipe: MoFERecipe, *, allow_pickle: bool = False) -> MergePlan:
    """Resolve sources, run every preflight check and list the output tensors (reads headers, never weights).

    Raises:
        PreflightError: all problems found, one per line.
        UnsupportedArchitecture: no output architecture accepts the base (with each one's reason).
    """
    refs = _refs(recipe)
    sources = resolve_sources(refs, relative_to=recipe.recipe_dir)
    ckpts = {label: Checkpoint(src.path, allow_pickle=allow_pickle) for label, src in sources.items()}
    try:
        base_cfg = _base_config(sources["base"].path)
        arch = select_output_arch(recipe.architecture, base_cfg, shared=recipe.shared_expert is not None)
        problems: list[str] = []
        warnings: list[str] = []
        base_t = _base_tensors(ckpts["base"], arch, problems)
        mlp_shapes = {
            name: base_t[name].shape
            for layer in range(base_cfg.num_hidden_layers)
            for proj in MLP_PROJS
            if (name := dense_mlp_name(layer, proj)) in base_t
        }
        base_tok = load_tokenizer(sources["base"].path)
        base_sig = tokenizer_signature(base_tok)
        for label, ck in ckpts.items():
            if label != "base":
                _check_expert(
                    refs[label][0],
                    ck,
                    base_cfg,
                    mlp_shapes,
                    base_sig,
                    shared=label == "shared",
                    problems=problems,
                    warnings=warnings,
                )
        if problems:
            raise PreflightError("\n".join(problems))
        if base_tok is not None:
            warnings += check_prompts(recipe, sources["base"].path, base_tok)
        warnings += _mixture_warnings(recipe, sources)
        shared_inter = None
        if recipe.shared_expert is not None:
            shared_inter = ckpts["shared"].tensors[dense_mlp_name(0, "gate_proj")].shape[0]
    finally:
        for c in ckpts.values():
            c.close()
    config = arch.make_config(
        base_cfg, n_experts=len(recipe.experts), top_k=recipe.experts_per_token, shared_intermediate=shared_inter
    )
    if recipe.norm_topk_prob is not None:
        if "norm_topk_prob" not in config:
            raise PreflightError(f"norm_topk_prob: the {arch.name} output has no such option")
        config["norm_topk_prob"] = recipe.norm_topk_prob
    # llama.cpp's converter, mlx-lm, vLLM: the ways a shared folder is used, warned about before it is shared
    warnings += consumer_caveats(config)
    ops = _ops(arch, base_t, recipe, base_cfg.num_hidden_layers, shared_inter, base_cfg.hidden_size)
    return MergePlan(
        recipe=recipe,
        arch=arch,
        config=config,
        ops=ops,
        sources=sources,
        dtype=recipe.dtype,
        warnings=warnings,
        allow_pickle=allow_pickle,
    )


def stacked_ops(arch: MoEArch, layer: int, experts: list[str], base_t: dict[str, Any]) -> list[TensorOp]:
    """The ops of an architecture that holds every expert of a layer in one tensor per group (``arch.stacked``)."""
    ops = []
    for template, projs in arch.stacked:
        srcs = [dense_mlp_name(layer, p) for p in projs]
        rows = sum(base_t[s].shape[0] for s in srcs)
        shape = (len(experts), rows, *base_t[srcs[0]].shape[1:])
        parts = tuple(tuple((e, s) for s in srcs) for e in experts)
        ops.append(TensorOp(template.format(layer=layer), "stacked", None, None, shape, parts))
    return ops


def _ops(
    arch: MoEArch,
    base_t: dict[str, Any],
    recipe: MoFERecipe,
    n_layers: int,
    shared_inter: int | None,
    hidden: int,
) -> list[TensorOp]:
    """Output tensors in file order: embeddings, then each layer (attention, norms, router, experts), then head."""
    by_layer: dict[int, list[str]] = {i: [] for i in range(n_layers)}
    head: list[str] = []
    tail: list[str] = []
    for name in base_t:
        if _MLP.match(name) or _IGNORED.fullmatch(name):
            continue
        m = _LAYER.match(name)
        if m:
            by_layer[int(m.group(1))].append(name)
        elif name.startswith("model.embed_tokens"):
            head.append(name)
        else:
            tail.append(name)
    ops = [TensorOp(n, "copy", "base", n, base_t[n].shape) for n in head]
    n_exp = len(recipe.experts)
    for layer in range(n_layers):
        names = sorted(by_layer[layer])
        ops += [TensorOp(n, "copy", "base", n, base_t[n].shape) for n in names]
        for proj in arch.zero_attn_bias:
            bias = f"model.layers.{layer}.self_attn.{proj}.bias"
            if bias not in base_t:
                rows = base_t[f"model.layers.{layer}.self_attn.{proj}.weight"].shape[0]
                ops.append(TensorOp(bias, "zeros", None, None, (rows,)))
        ops.append(TensorOp(arch.router_name(layer), "router", None, None, (n_exp, hidden)))
        ops += stacked_ops(arch, layer, [e.name for e in recipe.experts], base_t)
        for ei, e in enumerate(recipe.experts if not arch.stacked else []):
            for proj in MLP_PROJS:
                src = dense_mlp_name(layer, proj)
                ops.append(TensorOp(arch.expert_name(layer, ei, proj), "expert", e.name, src, base_t[src].shape))
        if recipe.shared_expert is not None and arch.shared and arch.shared_gate:
            for proj in MLP_PROJS:
                src = dense_mlp_name(layer, proj)
                shape = (shared_inter, hidden) if proj != "down_proj" else (hidden, shared_inter)
                ops.append(TensorOp(arch.shared.format(layer=layer, proj=proj), "shared", "shared", src, shape))  # type: ignore[arg-type]
            ops.append(TensorOp(arch.shared_gate.format(layer=layer), "shared_gate", None, None, (1, hidden)))
        else:  # Qwen2-MoE always has a shared expert: the null one adds exactly nothing (arch.outputs)
            for name, dims, value in arch.null_shared(layer, hidden):
                ops.append(TensorOp(name, "zeros" if value == 0 else "null_gate", None, None, dims))
    ops += [TensorOp(n, "copy", "base", n, base_t[n].shape) for n in sorted(tail)]
    return ops


# the shapes an MoE shares with the base it was merged from (its model_type is its own class's)
_TUNED_FOUNDATION = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def check_tuning_model(recipe: MoFERecipe, model: Path) -> None:
    """Refuse a ``--model`` this recipe's merge could not have written: router tuning trains the MoE the recipe
    built (its ``train:`` data and ``freeze:`` spec were written for it), so an MoE of another architecture or
    foundation is another recipe's model.

    The recipe's base decides, when it is here: an MoE of a class moetool writes must be the one the merge picks for
    that base (``architecture:``, or for ``auto`` the base family's own) and share its foundation (vocabulary,
    widths, layers, heads). Anything else (a base that is not here, a folder that is no such MoE) is left to the
    tuning's own checks, which name what is wrong with the folder itself.

    Raises:
        PreflightError: naming both architectures (or the differing foundation key) and both paths.
    """
    from moetool.arch.outputs import output_arch
    from moetool.io.sources import resolve_source

    if not (Path(model) / "config.json").is_file():
        return
    moe_cfg = Checkpoint(Path(model)).config
    given = moe_cfg.get("model_type")
    if output_arch(given) is None:
        return
    try:
        base = resolve_source(recipe.base_model, relative_to=recipe.recipe_dir).path
    except MoetoolError:
        return
    base_cfg = _base_config(base)
    arch = select_output_arch(recipe.architecture, base_cfg, shared=recipe.shared_expert is not None)
    if given != arch.model_type:
        raise PreflightError(
            f"--model {model} is a {given!r} MoE, but recipe {recipe.name!r} merges its {base_cfg.model_type!r} "
            f"base ({base}) into {arch.model_type!r}: tune the MoE this recipe merged (moetool merge RECIPE -o DIR), "
            "or use the recipe that model was built from"
        )
    base_keys = base_cfg.to_dict()
    for key in _TUNED_FOUNDATION:
        if moe_cfg.get(key) != base_keys.get(key):
            raise PreflightError(
                f"--model {model}: {key} is {moe_cfg.get(key)!r}, but recipe {recipe.name!r}'s base ({base}) has "
                f"{base_keys.get(key)!r}: that MoE was not merged from this recipe's base"
            )
