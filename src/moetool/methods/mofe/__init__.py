"""``method: mofe``: dense experts of one base → a standard MoE checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE).

plan (:mod:`.planner`: preflight from configs and headers, a weight-free tensor plan) → execute (:mod:`.execute`:
routers, one streamed tensor at a time, atomic output) → optional router tuning (:mod:`moetool.train`).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from moetool.methods.base import MergeOptions, MethodPlugin, TrainOptions, TrainOutcome
from moetool.methods.mofe.plan import MergePlan, TensorOp
from moetool.recipe.mofe import MoFERecipe


class MoFEPlugin(MethodPlugin[MoFERecipe, MergePlan]):
    """Its outputs are plain transformers MoE models: the standard exporters serve them."""

    name = "mofe"

    def check(self, recipe: MoFERecipe) -> list[str]:
        """The prompts (and chat template) against the base's tokenizer, when the base is available here."""
        from moetool.errors import MoetoolError
        from moetool.io.sources import resolve_source
        from moetool.methods.mofe.checks import check_prompts, load_tokenizer

        try:
            base = resolve_source(recipe.base_model, relative_to=recipe.recipe_dir).path
        except MoetoolError:
            return [
                f"base_model {recipe.base_model!r} is not available here: prompts not checked against its tokenizer"
            ]
        tok = load_tokenizer(base)
        if tok is None:
            return [f"base_model {base} has no tokenizer: prompts not checked"]
        return check_prompts(recipe, base, tok)

    def check_targets(self, recipe: MoFERecipe) -> None:
        """Nothing beyond the recipe's own validation: a MoFE output is a standard MoE, and its ``targets:`` (devices
        included) are the standard exporters', which plan each one."""

    def describe(self, recipe: MoFERecipe, *, allow_pickle: bool = False) -> MergePlan:
        from moetool.methods.mofe.planner import plan_mofe

        return plan_mofe(recipe, allow_pickle=allow_pickle)

    def merge(self, recipe: MoFERecipe, output: Path, options: MergeOptions) -> Path:
        from dataclasses import replace

        from moetool.compute.dtypes import resolve_device
        from moetool.methods.mofe.execute import execute

        resolve_device(options.device)  # an unusable --device is refused before any work
        plan = replace(self.describe(recipe, allow_pickle=options.allow_pickle), device=options.device or "auto")
        return execute(plan, output, force=options.force, console=options.console)

    def train(
        self, recipe: MoFERecipe, model: Path | None, output: Path, options: TrainOptions, console: Console
    ) -> TrainOutcome:
        from moetool.errors import MoetoolError
        from moetool.methods.mofe.planner import check_tuning_model
        from moetool.train.router_tuning import train_router

        if model is None:
            raise MoetoolError("--model: router tuning needs the merged MoE (moetool merge RECIPE -o DIR)")
        check_tuning_model(recipe, model)
        res = train_router(
            recipe,
            model,
            output,
            force=options.force,
            resume=options.resume,
            console=console,
            preset=options.preset,
            **options.extra,
        )
        figures = {
            "steps": f"{res.steps} in {res.seconds:.0f} s",
            "trainable": f"{res.freeze.trainable_params:,} parameters ({res.freeze.frozen_params:,} frozen)",
        }
        return TrainOutcome(output=res.output, figures=figures, detail=res)


PLUGIN = MoFEPlugin()

__all__ = ["PLUGIN", "MergePlan", "MoFEPlugin", "TensorOp"]
