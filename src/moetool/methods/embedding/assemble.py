"""The ``method: embedding`` assembler: ``moetool merge recipe.yaml -o OUT`` retrofits, checks, trains, checks
again and writes the model.

Checks written to ``moetool.json`` (and failing the build when a hard one fails):

- step 0: the retrofitted embedding against the rank-r SVD approximation of the old table (exact for generative,
  dense and selection: max |Δ| ≤ 1e-4 · max |E| or the build fails; remix is reported, it starts near it);
- cached decoding (router + body caches) against a whole-sequence forward (≤ 1e-5 of the largest logit or the
  build fails: 1.3e-5 on the toy zoo, 1.0e-4 with logits up to 33 on SmolLM2);
- the written directory reloaded with ``AutoModelForCausalLM`` against the in-memory model (≤ 1e-5 of the largest
  logit or it fails: 0 on the toy zoo, 5e-5 with logits up to 33 on SmolLM2);
- held-out perplexity of the original model and of the result on each training domain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from moetool.io.sources import ResolvedSource
    from moetool.methods.embedding.model import RoutedEmbeddingForCausalLM

import json
from pathlib import Path

import torch
from rich.console import Console

from moetool.errors import MoetoolError, PreflightError
from moetool.eval.perplexity import perplexity
from moetool.io.atomic import atomic_dir, check_output
from moetool.io.files import copy_tokenizer
from moetool.io.sources import resolve_source
from moetool.methods.base import MethodPlan
from moetool.methods.embedding.retrofit import TrainSettings, retrofit, svd_seed, table_of, train_embedding
from moetool.methods.embedding.router import causal_mask
from moetool.methods.embedding.variants import EmbeddingConfig, embedding_args, measured_counts, param_counts
from moetool.recipe.embedding import EmbeddingRecipe
from moetool.recipe.kept import write_kept_recipe
from moetool.train.data import load_source, sample_batch, tokenize_stream

EVAL_TOKENS = 4096  # held-out tokens per domain for the build's own perplexity figures


def load_source_model(
    ref: str, recipe_dir: Path | None
) -> tuple[ResolvedSource, PreTrainedModel, PreTrainedTokenizerBase]:
    """(resolved source, transformers model in fp32, tokenizer); errors name the ``model`` field."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        src = resolve_source(ref, relative_to=recipe_dir)
    except MoetoolError as exc:
        raise PreflightError(f"model: {exc}") from None
    try:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32).eval()
    except Exception as exc:
        raise PreflightError(f"model: cannot load {src.path} as a causal LM: {exc}") from None
    try:
        tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(src.path))
    except Exception as exc:
        raise PreflightError(f"model: {src.path} has no usable tokenizer: {exc}") from None
    if model.get_input_embeddings() is None or model.get_output_embeddings() is None:
        raise PreflightError(f"model: {src.path} has no input embedding table or output head to retrofit")
    return src, model, tok


def step0_check(model: RoutedEmbeddingForCausalLM, old: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    """Max |h - E_r[x]| of the retrofitted embedding against the rank-r SVD approximation, and against E itself."""

    cfg = model.embed.cfg
    _table, _proj, r = svd_seed(old, cfg.seed_dim, on_layernorm_sphere=cfg.variant == "generative")
    u, s, vh = torch.linalg.svd(old.double(), full_matrices=False)
    approx = ((u[:, :r] * s[:r]) @ vh[:r]).float()
    b, t = ids.shape
    with torch.no_grad():
        h, _, _ = model.embed(ids, torch.arange(t)[None].expand(b, t), causal_mask(t, 0, b))
    return {
        "svd_rank": r,
        "max_abs_vs_svd": float((h - approx[ids]).abs().max()),
        "max_abs_vs_original": float((h - old[ids]).abs().max()),
        "max_abs_table": float(old.abs().max()),
    }


# float32 cached decoding sums attention in another order than a full forward: the difference grows with depth and
# with the logits' size (1e-5 on the 4-layer zoo base, 1e-4 on 30-layer SmolLM2), so the bound is relative to them
CACHE_TOLERANCE = 1e-5


def cache_check(model: RoutedEmbeddingForCausalLM, ids: torch.Tensor, prefill: int) -> tuple[float, float]:
    """(max |Δlogit| between cached decoding (prefill, then one token at a time) and one whole-sequence forward,
    max |logit| of the full forward)."""
    with torch.no_grad():
        full = model(ids).logits
        logits, state = model.step(ids[:, :prefill])
        worst = float((logits - full[:, :prefill]).abs().max())
        for t in range(prefill, ids.shape[1]):
            logits, state = model.step(ids[:, t : t + 1], state)
            worst = max(worst, float((logits[:, 0] - full[:, t]).abs().max()))
    return worst, float(full.abs().max())


def batches_for(
    recipe: EmbeddingRecipe, tok: PreTrainedTokenizerBase, recipe_dir: Path | None
) -> tuple[Callable[[int], torch.Tensor], dict[str, str]]:
    """(step → ids [B, T], held-out text per domain)."""

    spec = recipe.train
    streams, held = [], {}
    for name, src in spec.data.items():
        train, valid = load_source(name, src, base_dir=recipe_dir, fraction=spec.validation_fraction, seed=spec.seed)
        streams.append(tokenize_stream(tok, train))
        held[name] = valid
    bos = getattr(tok, "bos_token_id", None)

    def batch(step: int) -> torch.Tensor:
        return sample_batch(streams, spec.batch_size, spec.seq_len, seed=spec.seed, step=step, bos_id=bos)

    return batch, held


class EmbeddingAssembler:
    """Plugin for ``method: embedding``."""

    name = "embedding"

    def describe(self, recipe: EmbeddingRecipe, *, recipe_dir: Path) -> MethodPlan:
        from transformers import AutoConfig

        try:
            src = resolve_source(recipe.model, relative_to=recipe_dir)
            cfg = AutoConfig.from_pretrained(str(src.path))
        except Exception as exc:
            raise PreflightError(f"model: {exc}") from None
        v, d = int(cfg.vocab_size), int(cfg.hidden_size)
        e = recipe.embedding
        counts = param_counts(
            EmbeddingConfig(
                vocab_size=v,
                d_model=d,
                max_positions=int(getattr(cfg, "max_position_embeddings", 512)),
                **e.module_kwargs(),  # type: ignore[arg-type]
            )
        )
        head = v * d if recipe.head == "keep" else 0
        lines = [
            f"embedding retrofit: {recipe.name} ← {recipe.model} ({cfg.model_type}, vocab {v}, hidden {d})",
            f"variant {e.variant}, seed_dim {e.seed_dim}, head {recipe.head}",
            f"original input table {v * d:,} params; routed embedding {counts['total']:,} "
            + ", ".join(f"{k} {n:,}" for k, n in counts.items() if k != "total" and n),
            f"output head: {head:,} params ({'separate V×D' if head else 'tied to the seed table via the projection'})",
            f"training: {recipe.train.steps} steps frozen body (lr {recipe.train.learning_rate}), "
            f"{recipe.train.unfreeze_steps} unfrozen; data {', '.join(recipe.train.data)}",
        ]
        parameters = {"input table": v * d, "routed embedding": counts["total"], "output head": head}
        return MethodPlan("embedding", recipe.name, {"model": str(recipe.model)}, parameters, tuple(lines))

    def assemble(
        self,
        recipe: EmbeddingRecipe,
        *,
        recipe_dir: Path,
        output: Path,
        force: bool = False,
        console: Console | None = None,
    ) -> Path:
        output = Path(output)
        check_output(output, force=force)  # before any work, not only at the final move
        torch.manual_seed(recipe.train.seed)
        log = (console.print) if console is not None else None
        src, source, tok = load_source_model(recipe.model, recipe_dir)
        old = table_of(source.get_input_embeddings()).clone()
        try:
            model = retrofit(source, embedding_args(recipe.embedding.module_kwargs()), head=recipe.head)
        except ValueError as exc:
            raise PreflightError(f"embedding: {exc}") from None
        model.eval()
        batch, held = batches_for(recipe, tok, recipe_dir)
        probe = batch(10**6)[:2, :32]
        step0 = step0_check(model, old, probe)
        if recipe.embedding.variant != "remix" and step0["max_abs_vs_svd"] > 1e-4 * step0["max_abs_table"]:
            raise MoetoolError(
                f"retrofit check failed: step-0 embedding is {step0['max_abs_vs_svd']:.3g} from the SVD approximation"
            )
        t = recipe.train
        s = TrainSettings.of(recipe.train)
        seconds = train_embedding(model, old, batch, s, log)
        cached, scale = cache_check(model, probe, prefill=16)
        if cached > CACHE_TOLERANCE * max(scale, 1.0):
            raise MoetoolError(
                f"cache check failed: cached decoding differs from a full forward by {cached:.3g} (logits up to "
                f"{scale:.3g}; the bound is {CACHE_TOLERANCE:g} of that)"
            )
        say = console.print if console is not None else (lambda *a, **k: None)
        say(f"step-0 check: |embedding − SVD seed| {step0['max_abs_vs_svd']:.2e} of max {step0['max_abs_table']:.2e}")
        say(f"cache check: cached decoding vs full forward, max |Δlogit| {cached:.2e} (logits up to {scale:.3g})")
        ppl = {
            name: {
                "original": perplexity(source, tok, text, seq_len=t.seq_len, max_tokens=EVAL_TOKENS),
                "retrofitted": perplexity(model, tok, text, seq_len=t.seq_len, max_tokens=EVAL_TOKENS),
            }
            for name, text in held.items()
        }
        for name, row in ppl.items():
            say(f"held-out perplexity {name}: original {row['original']:.2f} → retrofitted {row['retrofitted']:.2f}")
        with atomic_dir(output, force=force) as tmp:
            model.save_pretrained(str(tmp))
            copy_tokenizer(src.path, tmp)
            write_kept_recipe(tmp, recipe)
            reload = reload_check(tmp, model, probe)
            if reload > CACHE_TOLERANCE * max(scale, 1.0):
                raise MoetoolError(
                    f"reload check failed: the saved model differs by {reload:.3g} (logits up to {scale:.3g})"
                )
            meta = _meta(recipe, src, model, old, step0, (cached, reload), ppl, seconds, s.history)
            (tmp / "moetool.json").write_text(json.dumps(meta, indent=2))
        say(f"reload check: saved vs in-memory, max |Δlogit| {reload:.2e}")
        return output


def _meta(
    recipe: EmbeddingRecipe,
    src: ResolvedSource,
    model: RoutedEmbeddingForCausalLM,
    old: torch.Tensor,
    step0: dict[str, float],
    diffs: tuple[float, float],
    ppl: dict[str, dict[str, float]],
    seconds: float,
    history: list[dict[str, float]],
) -> dict[str, object]:
    """moetool.json: provenance, parameter counts and every check's figure (``diffs``: the max |Δlogit| of the
    cache check and of the reload check)."""

    v, d = old.shape
    return {
        "name": recipe.name,
        "method": "embedding",
        "provenance": {"sources": {"model": {"ref": src.ref, "path": str(src.path), "kind": src.kind}}},
        "embedding": {
            "variant": recipe.embedding.variant,
            "head": recipe.head,
            "params": {
                "original_table": v * d,
                "routed_embedding": measured_counts(model.embed),
                "head": v * d if recipe.head == "keep" else 0,
            },
            "step0": step0,
            "cached_vs_full_max_abs_logit_diff": diffs[0],
            "heldout_perplexity": ppl,
            "eval_tokens_per_domain": EVAL_TOKENS,
            "training": {"seconds": round(seconds, 1), "history": history},
            "reload_max_abs_logit_diff": diffs[1],
        },
    }


def reload_check(path: Path, model: RoutedEmbeddingForCausalLM, ids: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return float((again(ids).logits - model(ids).logits).abs().max())
