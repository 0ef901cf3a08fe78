"""``moetool merge`` for ``method: hybrid``: train the router and write the hybrid model directory.

Layout of the output::

    hybrid.json            experts (name, source, resolved path, architecture), costly expert, router config and
                           feature layout, loss, tokenizer check, held-out evaluation, training history
    router.safetensors     the router (input standardisation + MLP), float32
    latency_profile.json   each expert's latency over lengths and its fit (see profile.py)
    moetool-recipe.yaml    the recipe it was built from (moetool.recipe.kept, as every method's output keeps it)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir, check_output
from moetool.io.files import BUNDLE_LAYOUT, MOETOOL_META
from moetool.io.safe import read_json
from moetool.methods.base import MethodPlan
from moetool.methods.hybrid.pareto import train_recipe_router
from moetool.methods.hybrid.pipeline import Prepared, prepare
from moetool.methods.hybrid.profile import PROFILE_FILE
from moetool.methods.hybrid.records import (
    ChoiceFigures,
    ExpertRow,
    FeatureLayoutDoc,
    HeldOut,
    ModelMeta,
    RouterConfig,
    model_meta_from_json,
)
from moetool.methods.hybrid.router import HybridRouter, router_param_count
from moetool.methods.hybrid.training import evaluate_choice, oracle_choice, route, soft_nll
from moetool.recipe.hybrid import HybridRecipe
from moetool.recipe.kept import kept_recipe_text, write_kept_recipe

if TYPE_CHECKING:
    import torch

HYBRID_JSON = "hybrid.json"
ROUTER_FILE = "router.safetensors"
FORMAT = 1


def held_out_report(p: Prepared, router: HybridRouter) -> HeldOut:
    """Router vs each expert alone vs the oracle on the held-out requests."""
    r = p.recipe.router
    valid = p.valid
    shape = valid.features.shape[:-1]
    rows: dict[str, ChoiceFigures] = {}
    for k, name in enumerate(p.names):
        rows[f"{name} alone"] = evaluate_choice(valid, _full(shape, k), p.costly, alone=True)
    rows["oracle"] = evaluate_choice(valid, oracle_choice(valid, p.costly), p.costly)
    choice = route(router, valid, costly=p.costly, decision=r.decision, utility_threshold=r.utility_threshold)
    rows["router"] = evaluate_choice(valid, choice, p.costly)
    rows["router"]["soft_nll"] = soft_nll(router, valid)
    return HeldOut(requests=int(valid.features.shape[0]), rows=rows)


def _full(shape: torch.Size, k: int) -> torch.Tensor:
    import torch

    return torch.full(tuple(shape), k, dtype=torch.long)


def _router_config(p: Prepared) -> RouterConfig:
    r = p.recipe.router
    return RouterConfig(
        features=list(r.features),
        layout=FeatureLayoutDoc(
            length=p.layout.length,
            n_domains=p.layout.n_domains,
            hidden_dim=p.layout.hidden_dim,
            max_length=p.layout.max_length,
        ),
        domains=p.domains,
        in_features=p.layout.width,
        hidden_size=r.hidden_size,
        utility_head=r.utility_head,
        decision=r.decision,
        utility_threshold=r.utility_threshold,
        granularity=r.granularity,
        encoder=p.encoder.name if p.encoder is not None else None,
        encoder_layers=r.encoder_layers,
        parameters=router_param_count(p.layout.width, r.hidden_size, len(p.names), r.utility_head),
    )


class HybridAssembler:
    name = "hybrid"

    def describe(self, recipe: HybridRecipe, *, recipe_dir: Path) -> MethodPlan:
        r = recipe
        width_note = "the encoder's hidden size" if "hidden" in r.router.features else "0"
        lines = [
            f"hybrid '{r.name}': experts {', '.join(f'{e.name} ({e.source})' for e in r.experts)}",
            f"  costly expert: {r.costly} (auto: the slower at router.max_length per the latency profile)",
            f"  router: features {', '.join(r.router.features)} → MLP hidden {r.router.hidden_size} → 2 scores, "
            f"per {r.router.granularity}; hidden-state width: {width_note}",
            f"  loss: CE + {r.loss.lambda_balance}·{r.loss.balance} + {r.loss.lambda_penalty}·max(0, S_costly − "
            f"{r.loss.threshold}) + {r.loss.cost_weight}·Σ S_k c_k(L)",
            f"  data: {', '.join(r.train.data)}; {r.train.samples_per_domain} train / "
            f"{r.train.valid_samples_per_domain} held-out requests per domain, lengths "
            f"{r.train.min_length}–{r.router.max_length}",
            f"  profile: {r.profile.file or f'measured here as {r.profile.for_!r} at lengths {r.profile.lengths}'}",
        ]
        inputs = {f"expert {e.name}": str(e.source) for e in r.experts}
        return MethodPlan("hybrid", r.name, inputs=inputs, lines=tuple(lines))

    def assemble(
        self,
        recipe: HybridRecipe,
        *,
        recipe_dir: Path,
        output: Path,
        force: bool = False,
        console: Console | None = None,
    ) -> Path:
        r = recipe
        console = console or Console(stderr=True)
        check_output(Path(output), force=force)
        p = prepare(r, recipe_dir, console)
        console.print(f"training the router ({p.layout.width} features, {r.train.epochs} epochs)")
        res = train_recipe_router(p, r.loss)
        report = held_out_report(p, res.router)
        for name, row in report["rows"].items():
            console.print(
                f"  {name:>18}: perplexity {row['perplexity']:.2f}, costly share "
                f"{row['costly_share']:.3f}, expected latency {row['expected_latency_ms']:.2f} ms"
            )
        write_model(Path(output), p, res.router, report, res.history, force=force, recipe_dir=recipe_dir)
        return Path(output)


def write_model(
    output: Path,
    p: Prepared,
    router: HybridRouter,
    report: HeldOut,
    history: list[dict[str, float]],
    *,
    force: bool,
    recipe_dir: Path,
) -> None:
    from safetensors.torch import save_file

    meta = ModelMeta(
        format=FORMAT,
        method="hybrid",
        name=p.recipe.name,
        experts=[
            ExpertRow(name=e.name, source=s.source, path=str(e.path), model_type=e.model_type, kind=e.kind)
            for e, s in zip(p.experts, p.recipe.experts, strict=True)
        ],
        costly=p.names[p.costly],
        router=_router_config(p),
        loss=p.recipe.loss.model_dump(mode="json"),
        tokenizer=p.tokenizer_check,
        held_out=report,
        training={
            "history": [{k: v for k, v in h.items()} for h in history],
            **p.recipe.train.model_dump(mode="json", exclude={"data"}),
        },
        profile_device=p.profile["device"],
    )
    with atomic_dir(output, force=force) as tmp:
        state = {k: v.detach().contiguous() for k, v in router.state_dict().items()}
        save_file(state, str(tmp / ROUTER_FILE), metadata={"format": "pt"})
        (tmp / HYBRID_JSON).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        (tmp / PROFILE_FILE).write_text(json.dumps(p.profile, indent=2) + "\n", encoding="utf-8")
        write_kept_recipe(tmp, p.recipe)
        (tmp / MOETOOL_META).write_text(json.dumps(_moetool_meta(p, recipe_dir), indent=2) + "\n", encoding="utf-8")


def _moetool_meta(p: Prepared, recipe_dir: Path) -> dict[str, object]:
    """``moetool.json``: what every moetool output carries (method, name, provenance), and ``layout: bundle``: the
    experts stay where they are (hybrid.json names them), so the folder is a router bundle, packaged whole."""
    from moetool.card import provenance
    from moetool.io.sources import resolve_source

    sources = {e.name: resolve_source(e.source, relative_to=recipe_dir) for e in p.recipe.experts}
    return {
        "method": "hybrid",
        "name": p.recipe.name,
        "layout": BUNDLE_LAYOUT,
        "experts": list(p.names),
        "provenance": provenance(sources, kept_recipe_text(p.recipe)),
    }


def read_model(path: Path) -> tuple[ModelMeta, HybridRouter]:
    """The metadata and router of a hybrid model directory.

    Raises:
        MoetoolError: not a hybrid model directory (naming the missing file).
    """
    from safetensors.torch import load_file

    meta_path = Path(path) / HYBRID_JSON
    if not meta_path.is_file():
        raise MoetoolError(f"{path}: not a hybrid model ({HYBRID_JSON} missing; build one with `moetool merge`)")
    meta = model_meta_from_json(read_json(meta_path, what="hybrid model metadata"), str(meta_path))
    rc = meta["router"]
    router = HybridRouter(rc["in_features"], rc["hidden_size"], len(meta["experts"]), rc["utility_head"])
    router.load_state_dict(load_file(str(Path(path) / ROUTER_FILE)))
    router.eval()
    return meta, router
