"""GEM pathways: the general model and domain experts of one foundation, checked, and assembled token-level.

Token level: the general model's attention, norms and embeddings, with its FFN as the general pathway and each
expert's FFN as that domain's pathway (:func:`build_token_model`). Sequence level: each pathway is a whole model
(the general one or an expert), chosen once per input. Both check the foundation before reading any weight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetool.arch.families import FOUNDATION_KEYS, LLAMA
from moetool.errors import MoetoolError, PreflightError
from moetool.io.checkpoint import Checkpoint
from moetool.io.sources import ResolvedSource, resolve_sources
from moetool.methods.gem.model import GemConfig, GemForCausalLM
from moetool.methods.gem.scar import kmeans_cosine
from moetool.recipe.gem import GemRecipe

TOKEN_FAMILIES = (LLAMA.model_type,)  # the token-level model class is llama-architecture
_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass
class Pathways:
    """Resolved sources: ``general`` and one per domain (recipe order), plus the general model's config."""

    general: ResolvedSource
    domains: dict[str, ResolvedSource]
    config: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def resolve_pathways(recipe: GemRecipe, recipe_dir: Path | None) -> Pathways:
    """Resolve every source and check the foundation (configs and tensor headers only).

    Raises:
        PreflightError: every problem, one per line, naming the recipe field.
    """
    problems: list[str] = []
    refs = {"general": ("general", recipe.general)} | {
        d.name: (f"domains.{i}.source", d.source) for i, d in enumerate(recipe.domains)
    }
    srcs = resolve_sources(refs, relative_to=recipe_dir)
    cfgs = {}
    for label, src in srcs.items():
        try:
            cfgs[label] = Checkpoint(src.path).config
        except MoetoolError as exc:
            problems.append(f"{refs[label][0]}: {exc}")
    if problems:
        raise PreflightError("\n".join(problems))
    base = cfgs["general"]
    if recipe.level == "token" and base.get("model_type") not in TOKEN_FAMILIES:
        problems.append(
            f"general: token-level GEM supports {', '.join(TOKEN_FAMILIES)} models, not "
            f"{base.get('model_type')!r} (use level: sequence)"
        )
    if recipe.router.encoder_layers > int(base.get("num_hidden_layers", 0)):
        problems.append(
            f"router.encoder_layers: {recipe.router.encoder_layers} exceeds the general model's "
            f"{base.get('num_hidden_layers')} layers"
        )
    warnings: list[str] = []
    for i, d in enumerate(recipe.domains):
        cfg = cfgs[d.name]
        for key in (*FOUNDATION_KEYS, "intermediate_size"):
            if cfg.get(key) != base.get(key):
                problems.append(
                    f"domains.{i}.source: {key} is {cfg.get(key)!r} but the general model has "
                    f"{base.get(key)!r} (pathways must share one foundation)"
                )
        if recipe.level == "token":
            names = set(Checkpoint(srcs[d.name].path).tensors)
            missing = [n for n in Checkpoint(srcs["general"].path).tensors if _MLP.fullmatch(n) and n not in names]
            if missing:
                problems.append(f"domains.{i}.source: missing tensor {missing[0]!r}")
    if problems:
        raise PreflightError("\n".join(problems))
    return Pathways(srcs["general"], {d.name: srcs[d.name] for d in recipe.domains}, base, warnings)


def token_config(pw: Pathways, recipe: GemRecipe) -> Any:

    keep = {
        k: v
        for k, v in pw.config.items()
        if k
        not in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "auto_map", "use_cache")
    }
    return GemConfig(
        **keep,
        domains=[d.name for d in recipe.domains],
        tau=recipe.router.tau,
        encoder_layers=recipe.router.encoder_layers,
        router_context=recipe.router.context,
        scar_clusters=recipe.scar.clusters,
        use_cache=False,
        architectures=["GemForCausalLM"],
    )


def _state(path: Path) -> dict[str, torch.Tensor]:
    ck = Checkpoint(path)
    try:
        return {n: ck.get(n).float() for n in ck.tensors}
    finally:
        ck.close()


def build_token_model(pw: Pathways, recipe: GemRecipe) -> tuple[Any, list[str]]:
    """The token-level model in float32 with a zero router (every token general until the router trains).

    Returns the model and notes (e.g. experts whose non-FFN weights differ from the general model's: only their FFNs
    are used, so their own attention changes are dropped).
    """

    cfg = token_config(pw, recipe)
    model = GemForCausalLM(cfg).float().eval()
    general = _state(pw.general.path)
    own = model.state_dict()
    notes: list[str] = []
    with torch.no_grad():
        for name, t in general.items():
            if "rotary_emb" in name:
                continue
            if name not in own:
                raise PreflightError(f"general: tensor {name!r} has no place in the moetool_gem model")
            own[name].copy_(t)
        for d, dom in enumerate(recipe.domains):
            ex = _state(pw.domains[dom.name].path)
            drift = 0.0
            for name, t in ex.items():
                m = _MLP.fullmatch(name)
                if m:
                    own[f"model.layers.{m.group(1)}.mlp.pathways.{d}.{m.group(2)}.weight"].copy_(t)
                elif name in general and "rotary_emb" not in name:
                    drift = max(drift, float((t - general[name]).abs().max()))
            if drift > 0:
                notes.append(
                    f"{dom.name}: non-FFN weights differ from the general model's (max |Δ| {drift:.3g}); "
                    "token-level GEM uses only this expert's FFNs"
                )
        model.model.router.weight.zero_()
        model.model.router.bias.zero_()
        if cfg.tie_word_embeddings:
            model.tie_weights()
    return model, notes


@torch.no_grad()
def token_parity(model: Any, pw: Pathways, recipe: GemRecipe, ids: torch.Tensor) -> dict[str, float]:
    """Max |Δlogit| of the assembled model against its sources on ``ids`` [1, T]:

    ``general``: every token forced to the general pathway vs the general model; ``<domain>``: every token forced
    to that pathway vs the expert itself (exact when the expert differs from the general model only in its FFNs).
    Without SCAR; with SCAR the model is a different function by design.
    """
    from transformers import AutoModelForCausalLM

    saved = model.config.scar_clusters
    model.config.scar_clusters = 0
    out: dict[str, float] = {}
    try:
        for p, (name, src) in enumerate([("general", pw.general), *pw.domains.items()]):
            ref = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32).eval()
            want = ref(ids).logits
            got = model(ids, route=torch.full_like(ids, p)).logits
            out[name] = float((want - got).abs().max())
            del ref
    finally:
        model.config.scar_clusters = saved
    return out


@torch.no_grad()
def fit_scar_centroids(model: Any, windows: list[torch.Tensor], iterations: int, seed: int = 0) -> None:
    """Fit each layer's k cosine centroids on the attention inputs of the general pathway over ``windows``.

    Layer i's points are the normed inputs of layer i's attention [N, D] with SCAR already active in layers < i
    (so each layer is fitted on what it will see).
    """

    gm = model.model
    k = model.config.scar_clusters
    for i in range(len(gm.layers)):
        pts = []
        for ids in windows:
            x = gm.embed_tokens(ids)
            t = ids.shape[1]
            pe = gm.rotary_emb(x, torch.arange(t)[None])
            causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
            for j in range(i):
                x = gm._layer(j, x, pe, causal, None)
            pts.append(gm.layers[i].input_layernorm(x).reshape(-1, x.shape[-1]))
        gm.scar_centroids[i].copy_(kmeans_cosine(torch.cat(pts), k, iterations, seed=seed + i))
