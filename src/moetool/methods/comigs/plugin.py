"""The ``comigs`` plugin: assemble the untrained per-user models, train the federation, export a user's model
(baked into a standard Mixtral first, exactly, then through the standard exporters)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from moetool import registry
from moetool.errors import MoetoolError
from moetool.export.base import Exporter, ExportJob, ExportRequest, Origin, get_exporter
from moetool.export.parity import ParityRecord
from moetool.io.atomic import scratch_dir
from moetool.io.jsontypes import JsonObject
from moetool.methods.base import AssemblerPlugin, MethodExportPlan, TrainOptions, TrainOutcome
from moetool.recipe.comigs import ComigsRecipe

if TYPE_CHECKING:
    from moetool.methods.comigs.bake import BakeReport


def bake_parity(bake: BakeReport) -> ParityRecord:
    """The baked Mixtral against the CoMiGS model it was baked from, as a manifest's ``baked_from.parity``: float64
    logits on the bake probe, held to the bake's tolerance (the float32 figure kept beside it)."""
    return ParityRecord(
        runtime="transformers MixtralForCausalLM float64 (the baked checkpoint, reloaded)",
        reference="ComigsForCausalLM float64",
        tokens=bake["parity_tokens"],
        max_abs_logit_diff=bake["parity_max_abs_logit_diff"],
        tolerance=bake["parity_tol"],
        verdict="pass" if bake["parity_max_abs_logit_diff"] <= bake["parity_tol"] else "fail",
        extra={"max_abs_logit_diff_float32": bake["parity_max_abs_logit_diff_float32"]},
    )


def export_baked(req: ExportRequest, target: str, console: Console) -> JsonObject:
    """Bake the user model into a Mixtral in a temporary folder beside the output, export that, note the bake."""
    from moetool.export.resolve import resolve_quant
    from moetool.methods.comigs.bake import bake_user

    # named as the output's own temporary folder, so a killed bake is swept by the next write of the output
    with scratch_dir(req.output, "bake") as tmp:
        baked = tmp / "baked"
        bake = bake_user(req.model_dir, baked)
        console.print(
            f"bake: {req.model_dir.name} → Mixtral ({len(bake['experts'])} experts, top-{bake['top_k']}); "
            f"parity max |Δlogit| {bake['parity_max_abs_logit_diff']:.2e} (float64)",
            highlight=False,
        )
        exporter = get_exporter(target)
        # the manifest names the user's folder and records the bake in its one write (not the temporary copy)
        origin = Origin(
            path=req.model_dir, key="baked_from", record={"comigs_user": str(req.model_dir)}, parity=bake_parity(bake)
        )
        sub = replace(
            req,
            model_dir=baked,
            quant=resolve_quant(baked, req.options.get("quant"), None, exporter.default_quant),
            origin=origin,
        )
        return ExportJob(exporter, sub, exporter.plan(sub)).run(console)


class ComigsPlugin(AssemblerPlugin[ComigsRecipe]):
    name = "comigs"
    assembler = "moetool.methods.comigs.pipeline:ComigsAssembler"
    model_types = ("moetool_comigs",)
    model_modules = ("moetool.methods.comigs.model",)
    export_targets = tuple(registry.TARGETS)

    def train(
        self, recipe: ComigsRecipe, model: Path | None, output: Path, options: TrainOptions, console: Console
    ) -> TrainOutcome:
        """The federation in one process (``moetool comigs train --engine flower`` runs it on Flower); options
        ``variant`` (comigs or a baseline) and ``rounds``."""
        from moetool.methods.comigs.federated import VARIANTS
        from moetool.methods.comigs.pipeline import train

        r = recipe
        unknown = sorted(set(options.extra) - {"variant", "rounds"})
        if unknown:
            raise MoetoolError(f"{', '.join(f'--{k}' for k in unknown)}: not an option of CoMiGS training (mofe only)")
        variant = options.extra.get("variant", "comigs")
        rounds = options.extra.get("rounds")
        if variant not in VARIANTS:
            raise MoetoolError(f"--variant: {variant!r} is not one of {', '.join(VARIANTS)}")
        if rounds is not None:
            r = r.model_copy(update={"training": r.training.model_copy(update={"rounds": rounds})})
        report = train(r, r.recipe_dir, output, variant=variant, force=options.force, log=console.print)
        figures = {
            f"{name} test perplexity": f"{u['test_ppl_before']:.2f} → {u['test_ppl']:.2f}"
            for name, u in report["users"].items()
        }
        return TrainOutcome(output=output, figures=figures, detail=report)

    def exporter(self, model_dir: Path, target: str | None) -> Exporter[MethodExportPlan]:
        return self.function_exporter(
            model_dir,
            target or "gguf",
            export_baked,
            lambda t: f"bake the CoMiGS user model into a standard Mixtral (exact), then export it as {t}",
        )
