"""``moetool export --target mlx``: an mlx-lm folder (Apple silicon; mlx's CPU build on Linux) with the plan's
precision per role — by default experts 4-bit, router and norms kept, everything else 8-bit, MLX's affine groups —
checked in mlx-lm against transformers float32.

mlx-lm computes an MoE sparsely (``SwitchGLU``: ``gather_qmm`` over the chosen experts only). Files:
``model.safetensors``, ``config.json`` (with ``quantization``: the default and one entry per module that differs),
the tokenizer files, ``manifest.json``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from moetool.arch.consumers import MLX_LM, differing
from moetool.arch.outputs import output_arch
from moetool.arch.records import model_record, topk_rule
from moetool.arch.released import released_config
from moetool.export.base import NOT_VERIFIED, ArtifactPlan, ExportError, ExportRequest, write_manifest
from moetool.export.graph.parity import judge
from moetool.export.heldout import held_out_text
from moetool.export.mlx.names import mlx_precision, module_paths, module_precisions
from moetool.export.parity import ParityRecord
from moetool.export.planning import choose_plan, manifest_base
from moetool.io.atomic import atomic_dir
from moetool.io.budget import Need, human
from moetool.io.checkpoint import Checkpoint
from moetool.io.files import copy_tokenizer
from moetool.io.jsontypes import JsonObject
from moetool.progress import step_printer
from moetool.quant.plan import TensorEntry

# an f32 folder against transformers: mlx's float32 kernels sum in another order (the real SmolLM2 MoE: 1.75e-4 at 128
# tokens, logits of magnitude ~20); the same bound as GGUF's f32 gate, another runtime's float32 kernels
F32_GATE = 1e-3
# the config keys mlx-lm reads that a folder merged before the released form (arch.released) may lack
_RELEASED_KEYS = ("rope_theta", "rope_scaling", "num_experts", "num_local_experts")


def check_topk(cfg: Mapping[str, object]) -> None:
    """Refuse a model whose top-k routing weights mlx-lm's class for its type weights otherwise (Qwen2-MoE's never
    renormalises, whatever ``norm_topk_prob`` says: ``arch.consumers.MLX_LM``): the folder would compute another
    function, and the f32 parity gate would say so only after the whole export.

    Raises:
        ExportError: naming ``norm_topk_prob``, what mlx-lm does, and the recipe setting it computes.
    """
    rule = topk_rule(cfg)
    if rule is None or MLX_LM not in differing(cfg, rule[1]):
        return
    rec, norm = rule
    fix = f"merge it with `norm_topk_prob: {str(not norm).lower()}` in the recipe, or " if rec.topk == "config" else ""
    raise ExportError(
        f"--target mlx: this {rec.model_type} has norm_topk_prob: {str(norm).lower()}, but mlx-lm "
        f"({MLX_LM.checked}) {'never' if norm else 'always'} renormalises its top-k routing weights: the MLX folder "
        f"would compute another function. Nothing was written; {fix}export it to another target (onnx)"
    )


# Peak RSS of `moetool export --target mlx` (bench/size_ladder.measured: the process tree sampled, and wait4; the
# 360m verification's from /usr/bin/time -v), 2026-12-06, mlx 0.32.4 CPU build:
#   tiny Mixtral (214K params):  moe-q4 written 0.30 GB, verified 0.48 GB; f32 verified 0.48 GB
#   size ladder 360m (1.07B parameters, bf16 2.14 GB; the artifact 0.67 GB at moe-q4, 4.28 GB at f32):
#     moe-q4 written 1.21 GB, f32 written 6.87 GB; verified (the machine idle): moe-q4 10.54 GB in 7 min 42 s,
#     f32 14.12 GB in 7 min 23 s (estimated 11.2 and 14.8 GB)
# Writing: mlx-lm loads the model lazily and evaluates the artifact's arrays as it saves them, so the peak follows the
# artifact, not the source: the overhead + 1.6 x the artifact (1.40 and 7.18 GB estimated for the two 360m figures).
WRITE_OVERHEAD = 320 << 20  # python, mlx and mlx-lm: the tiny model's 0.30 GB
WRITE_MULTIPLE = 1.6
# Verifying: transformers loads the model in float32 (from bf16: both copies for a moment) beside mlx-lm's copy of
# the artifact: 2.0 x the float32 weights + the artifact + VERIFY_OVERHEAD is the 360m figure (10.30 GB); 2.2 leaves
# room for the probe windows' activations (11.2 GB estimated)
VERIFY_MULTIPLE = 2.2


def mlx_need(plan: MLXPlan, *, verify: bool, output: Path) -> Need:
    """Memory and disk of writing (and verifying) ``plan``'s MLX folder, from the plan alone (the fitted figures
    above): the artifact is the disk; writing holds about 1.6 x the artifact, verification the float32 model beside
    it."""
    from moetool.export.reference import VERIFY_OVERHEAD

    params, artifact = plan.quant.total_params, plan.quant.total_bytes
    writing = WRITE_OVERHEAD + int(artifact * WRITE_MULTIPLE)
    verifying = int(params * 4 * VERIFY_MULTIPLE) + artifact + VERIFY_OVERHEAD
    memory, detail = writing, "written by mlx-lm"
    if verify:
        memory, detail = max(writing, verifying), f"{detail} ({human(writing)}); verified against the model in float32"
    way_out = "Export with --no-verify (the folder is not checked), or on a machine with more memory"
    return Need(f"MLX export ({plan.quant.label})", memory, detail, disk=artifact, output=output, way_out=way_out)


class MLXPlan(ArtifactPlan):
    def module_paths(self) -> dict[str, list[str]]:
        """mlx-lm module path → the Hugging Face tensors its weight is made of."""
        return module_paths(
            output_arch(self.config.get("model_type")), [a.entry.hf_name for a in self.quant.assignments]
        )

    def module_precisions(self) -> dict[str, str]:
        """mlx-lm module path → MLX precision (``f32``, ``bf16``, ``4-bit``, …)."""
        return module_precisions(self.module_paths(), {a.entry.hf_name: a.type for a in self.quant.assignments})


class MLXExporter:
    name = "mlx"
    requires = "mlx"
    # what mlx-community's MoEs are: experts 4-bit, the rest 8-bit (the router kept float, as in every preset)
    default_quant = "moe-q4"

    def plan(self, req: ExportRequest) -> MLXPlan:
        ck = Checkpoint(req.model_dir)
        cfg = ck.config
        if model_record(cfg.get("model_type")) is None:
            raise ExportError(
                f"--target mlx: {req.model_dir} is a {cfg.get('model_type')!r} model; mlx-lm classes are known for "
                "the Llama, Mistral, Qwen and Granite families and their MoEs (export a method's model with its own "
                "targets)"
            )
        check_topk(cfg)
        entries = [TensorEntry(n, tuple(info.shape)) for n, info in ck.tensors.items()]
        # no GGUF block fallback: mlx quantizes any row that a group of 64 or 32 divides (runtime.write_folder)
        c = choose_plan(req, entries, cfg, "mlx", precision_of=mlx_precision, fit_rows=False)
        plan = MLXPlan(**c.plan_fields(req, cfg))
        try:
            plan.module_precisions()
        except ValueError as exc:
            raise ExportError(f"plan {c.quant.label!r} for mlx: {exc}") from None
        return plan

    def need(self, req: ExportRequest, plan: MLXPlan) -> Need:
        """The export's memory and disk need (:func:`mlx_need`)."""
        return mlx_need(plan, verify=req.verify, output=req.output)

    def export(self, req: ExportRequest, plan: MLXPlan, console: Console | None = None) -> JsonObject:
        from moetool.export.mlx import runtime

        runtime.versions()  # no mlx-lm: refuse before anything is written
        self.need(req, plan).check()
        started = time.perf_counter()
        step = step_printer(console, started)
        released = released_config(plan.config)
        overrides = {k: released[k] for k in _RELEASED_KEYS if k in released}
        precisions = plan.module_precisions()
        with atomic_dir(req.output, force=req.force) as tmp:
            step(f"writing the mlx-lm folder with mlx-lm's loader and quantizer ({plan.quant.label})")
            config, notes = runtime.write_folder(req.model_dir, tmp, precisions, overrides)
            copy_tokenizer(req.model_dir, tmp, overwrite=False)
            parity: ParityRecord | str = NOT_VERIFIED
            if req.verify:
                step("checking the folder in mlx-lm against transformers")
                text, src = held_out_text(req.model_dir, req.eval_text)
                parity = replace(runtime.check_folder(tmp, req.model_dir, text, plan.module_paths()), text=src)
                lossless = all(p == "f32" for p in precisions.values())
                parity = judge(parity, "MLX (f32)", limit=F32_GATE) if lossless else parity.judged(None)
            files = {p.name: p for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest = manifest_base("mlx", plan, files, "model.safetensors")
            manifest["plan"]["mlx_precisions"] = dict(Counter(precisions.values()))
            manifest |= {
                "runtime": runtime.versions(),
                "quantization": config.get("quantization"),
                "moe_kernel": {"kind": "sparse", "op": "mlx-lm SwitchGLU (gather_mm / gather_qmm over the top-k)"},
                "load": "mlx_lm.load(folder) or mlx_lm.generate --model folder",
                "notes": manifest["notes"] + notes,
                "parity": parity.to_json() if isinstance(parity, ParityRecord) else parity,
                "timing_s": {"total": round(time.perf_counter() - started, 3)},
            }
            write_manifest(tmp, manifest)
        return manifest
