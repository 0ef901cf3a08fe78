"""From a recipe to routing data: experts loaded and checked, latency profile, requests, cached expert outputs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from moetool.errors import MoetoolError
from moetool.methods.hybrid.data import Requests, expert_outputs, sample_requests
from moetool.methods.hybrid.experts import Expert, check_tokenizers, load_expert
from moetool.methods.hybrid.profile import LatencyProfile, cost_ms, costly_expert, load_profile, time_profile
from moetool.methods.hybrid.records import TokenizerCheck
from moetool.methods.hybrid.router import FeatureLayout
from moetool.methods.hybrid.training import RoutingSet, build_set
from moetool.recipe.hybrid import HybridRecipe
from moetool.train.data import load_source, tokenize_stream


@dataclass
class Prepared:
    """Everything a router is trained and judged on."""

    recipe: HybridRecipe
    experts: list[Expert]
    names: list[str]
    costly: int
    layout: FeatureLayout
    domains: list[str]
    profile: LatencyProfile
    tokenizer_check: TokenizerCheck
    train: RoutingSet
    valid: RoutingSet
    valid_requests: Requests
    encoder: Expert | None


def load_experts(recipe: HybridRecipe, recipe_dir: Path) -> tuple[list[Expert], TokenizerCheck]:
    experts = [load_expert(e.name, e.source, relative_to=recipe_dir) for e in recipe.experts]
    return experts, check_tokenizers(experts)


def get_profile(recipe: HybridRecipe, recipe_dir: Path, experts: list[Expert]) -> LatencyProfile:
    """The recipe's profile file (relative to the recipe), else measured here now."""
    names = [e.name for e in experts]
    spec = recipe.profile
    if spec.file:
        path = Path(spec.file)
        return load_profile(path if path.is_absolute() else recipe_dir / path, names)
    vocab = len(experts[0].tokenizer)
    return time_profile(
        {e.name: e.model for e in experts},
        device=spec.for_,
        lengths=spec.lengths,
        repeats=spec.repeats,
        threads=spec.threads,
        vocab=vocab,
        clock_name=spec.clock,
    )


def prepare(
    recipe: HybridRecipe, recipe_dir: Path, console: Console | None = None, *, cache: Path | None = None
) -> Prepared:
    """Load, check, profile, sample requests and run both experts over them (the slow part; minutes on the zoo).

    ``cache``: a file keeping the requests and expert outputs between runs (reused only when the experts, data and
    router settings it was made with are the recipe's; costs are always recomputed from the current profile).
    """
    console = console or Console(stderr=True)
    experts, tok_check = load_experts(recipe, recipe_dir)
    names = [e.name for e in experts]
    kinds = ", ".join(f"{e.name} ({e.model_type}, {e.kind})" for e in experts)
    console.print(f"experts: {kinds}; tokenizers identical ({tok_check['vocab_size']} tokens)")
    with console.status("latency profile"):
        profile = get_profile(recipe, recipe_dir, experts)
    costly = (
        names.index(recipe.costly)
        if recipe.costly != "auto"
        else costly_expert(profile, names, recipe.router.max_length)
    )
    console.print(f"costly expert: {names[costly]} (profile: {profile['device']})")
    spec = recipe.router
    encoder = None
    if "hidden" in spec.features:
        encoder = experts[names.index(spec.encoder)] if spec.encoder else experts[0]
    domains = list(recipe.train.data)
    layout = FeatureLayout(
        length="length" in spec.features,
        n_domains=len(domains) if "domain" in spec.features else 0,
        hidden_dim=encoder.hidden_size if encoder is not None else 0,
        max_length=spec.max_length,
    )
    train_streams, valid_streams, bos, pad = _token_streams(recipe, recipe_dir, experts[0], names[0])
    key = json.dumps(
        [recipe.model_dump(mode="json", include={"experts", "train", "router"}), [str(e.path) for e in experts]],
        sort_keys=True,
    )
    if cache is not None and cache.is_file():
        loaded = _load_cache(cache, key)
        if loaded is not None:
            console.print(f"requests and expert outputs from {cache}")
            sets, reqs = loaded
            for s_, r_ in zip(sets, reqs, strict=True):
                s_.cost = cost_ms(profile, names, r_.lengths)
            return Prepared(
                recipe, experts, names, costly, layout, domains, profile, tok_check, sets[0], sets[1], reqs[1], encoder
            )
    sets, reqs = [], []
    for split, streams, per, seed in (
        ("train", train_streams, recipe.train.samples_per_domain, recipe.train.seed),
        ("valid", valid_streams, recipe.train.valid_samples_per_domain, recipe.train.seed + 1),
    ):
        try:
            req = sample_requests(
                streams,
                per_domain=per,
                min_length=recipe.train.min_length,
                max_length=spec.max_length,
                bos_id=bos,
                pad_id=pad,
                seed=seed,
            )
        except ValueError as exc:
            raise MoetoolError(f"train.data: {split} text too short: {exc}") from None
        with console.status(f"running both experts over {len(req)} {split} requests"):
            outs = expert_outputs(experts, req, encoder=encoder, encoder_layers=spec.encoder_layers)
        sets.append(build_set(layout, spec.granularity, req, outs, cost_ms(profile, names, req.lengths)))
        reqs.append(req)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _save_cache(cache, key, sets, reqs)
    return Prepared(
        recipe, experts, names, costly, layout, domains, profile, tok_check, sets[0], sets[1], reqs[1], encoder
    )


def _token_streams(
    recipe: HybridRecipe, recipe_dir: Path, first: Expert, name: str
) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int]:
    """Train and held-out token streams per domain (the first expert's tokenizer: they are identical), BOS and pad."""

    tok = first.tokenizer
    train_streams, valid_streams = [], []
    for domain, src in recipe.train.data.items():
        tr, va = load_source(
            domain, src, base_dir=recipe_dir, fraction=recipe.train.validation_fraction, seed=recipe.train.seed
        )
        train_streams.append(tokenize_stream(tok, tr))
        valid_streams.append(tokenize_stream(tok, va))
    bos = tok.bos_token_id
    if bos is None:
        raise MoetoolError(f"expert {name!r}: the tokenizer has no BOS token (requests start with one)")
    pad = tok.pad_token_id if tok.pad_token_id is not None else bos
    return train_streams, valid_streams, bos, pad


_SET_FIELDS = ("features", "logp", "mask", "lengths", "cost", "domains")
_REQ_FIELDS = ("ids", "lengths", "domains")


def _save_cache(path: Path, key: str, sets: list[RoutingSet], reqs: list[Requests]) -> None:
    """safetensors, written to a temporary sibling and renamed (atomic)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for split, st, rq in zip(("train", "valid"), sets, reqs, strict=True):
        tensors |= {f"{split}.set.{f}": getattr(st, f).contiguous().clone() for f in _SET_FIELDS}
        tensors |= {f"{split}.req.{f}": getattr(rq, f).contiguous().clone() for f in _REQ_FIELDS}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"key": key})
    tmp.replace(path)


def _load_cache(path: Path, key: str) -> tuple[list[RoutingSet], list[Requests]] | None:
    """The cached sets and requests, or None when they were made for other settings."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("key") != key:
            return None
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    sets = [RoutingSet(*(t[f"{s}.set.{f}"] for f in _SET_FIELDS)) for s in ("train", "valid")]
    reqs = [Requests(*(t[f"{s}.req.{f}"] for f in _REQ_FIELDS)) for s in ("train", "valid")]
    return sets, reqs
