"""``moetool export --target gguf``: plan → write (→ llama.cpp K-quant pass) → parity in llama.cpp → manifest."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from moetool.export.base import NOT_VERIFIED, ExportError, ExportRequest, write_manifest
from moetool.export.gguf.dequant import ArtifactTensors, ArtifactWeights, artifact_checkpoint
from moetool.export.gguf.layout import Layout, plan_layout
from moetool.export.gguf.tokenizer import llama_cpp_equivalent, read_vocab
from moetool.export.gguf.write import by_ggml, write_gguf
from moetool.export.heldout import held_out_text
from moetool.export.parity import ParityRecord
from moetool.export.planning import ArtifactPlan, choose_plan, manifest_base
from moetool.io.atomic import atomic_dir
from moetool.io.budget import Need
from moetool.io.checkpoint import Checkpoint
from moetool.quant.allocate import Allocation, BudgetTooSmall, allocate
from moetool.quant.imatrix import FILE_SUFFIX, Calibration, ImatrixError, ImportanceMatrix
from moetool.quant.imatrix import load as load_imatrix
from moetool.quant.plan import QuantPlan, QuantRule, TensorEntry, resolve
from moetool.quant.roles import role_of
from moetool.quant.types import NEEDS_IMATRIX, TYPES

if TYPE_CHECKING:  # verify is imported only when an export is verified
    from moetool.export.gguf.verify import ParityReport

# Conversion gates: llama.cpp against transformers running the artifact's own weights. f32 ≤ 1e-3 and f16 ≤ 1e-2
# (llama.cpp rounds activations to the weight type in its dot products, ~5e-3 at f16 and ~4e-2 at bf16). With
# quantized weights llama.cpp also quantizes activations to 8 bits, so logits move by ~0.1-1: there (and for every
# plan, against the source model) the margin gate of moetool.export.gate decides: top-1 agreement where the
# reference's margin exceeds what rounding can move, and mean KL under the type family's bound. Raw top-1 agreement
# (the old gate, >= 0.95) counted near-ties as failures and is only recorded.
GATES = {"f32": 1e-3, "f16": 1e-2, "bf16": 1e-1}
# the router cannot be a K type: llama.cpp's quantizer never touches ffn_gate_inp and gguf-py cannot write K types
_ROUTER_K = {f"router:{t}": "q8_0" for t in TYPES if not TYPES[t].python}


@dataclass
class GGUFPlan(ArtifactPlan):
    layout: Layout = field(kw_only=True)


class GGUFExporter:
    """The GGUF target: one file for llama.cpp, its steps as the module docstring says."""

    name = "gguf"
    requires = "llama"
    default_quant = "f16"

    def plan(self, req: ExportRequest) -> GGUFPlan:
        ckpt = Checkpoint(req.model_dir)
        cfg = ckpt.config
        shapes = {n: t.shape for n, t in ckpt.tensors.items()}
        layout = plan_layout(cfg, shapes)
        entries = [t.entry() for t in layout.tensors]
        if req.quant.budget is not None:  # planned at q8_0 (an upper bound), routers f32; export() allocates
            rules = list(req.quant.rules)
            if any(_role(e) == "router" for e in entries) and not any(r.role == "router" for r in rules):
                rules.append(QuantRule(role="router", type="f32"))
            spec = req.quant.model_copy(update={"default": req.quant.default or "q8_0", "rules": rules})
            req = dataclasses.replace(req, quant=spec)
        c = choose_plan(req, entries, cfg, "gguf", cannot=_ROUTER_K)
        return GGUFPlan(**c.plan_fields(req, cfg), layout=layout)

    def check(self, req: ExportRequest, plan: GGUFPlan) -> None:
        """Refuse before anything is written: a type that needs an importance matrix without one.

        Raises:
            ExportError: naming the tensors' types and ``--imatrix``.
        """
        if req.quant.budget is not None and not isinstance(req.imatrix, Calibration):
            raise ExportError(
                "--quant budget=… allocates bits by measured sensitivity on calibration text: pass --imatrix auto "
                "(with --calibration FILE, or the recipe's domain data)"
            )
        low = sorted({a.type for a in plan.quant.assignments if a.type in NEEDS_IMATRIX})
        if low and req.imatrix is None:
            raise ExportError(
                f"{', '.join(low)} need an importance matrix (as llama.cpp refuses its low-bit types without one): "
                f"pass --imatrix auto (collected on the recipe's domain data or --calibration FILE) or --imatrix "
                f"FILE.imatrix.gguf"
            )

    def need(self, req: ExportRequest, plan: GGUFPlan) -> Need:
        """The export's memory and disk need (:func:`gguf_need`); an importance matrix collected here loads the
        model."""
        return gguf_need(
            plan,
            verify=req.verify,
            output=req.output,
            collect=req.imatrix is not None and not isinstance(req.imatrix, Path),
        )

    def export(self, req: ExportRequest, plan: GGUFPlan, console: Console | None = None) -> dict[str, Any]:

        self.check(req, plan)
        vocab = read_vocab(req.model_dir, int(plan.config["vocab_size"]))
        imatrix = load_imatrix(req.imatrix) if isinstance(req.imatrix, Path) else None
        fname = f"{plan.name}.{plan.quant.label}.gguf"
        self.need(req, plan).check()
        t0 = time.perf_counter()
        with atomic_dir(req.output, force=req.force) as tmp:
            target = tmp / fname
            imatrix_file = None
            allocation = None
            if req.imatrix is not None:
                imatrix, imatrix_file = self._imatrix(req, plan, imatrix, tmp / (plan.name + FILE_SUFFIX), console)
            if req.quant.budget is not None:
                assert imatrix is not None and isinstance(req.imatrix, Calibration)
                allocation = allocate_plan(req, plan, imatrix, req.imatrix, console)
            ckpt = Checkpoint(req.model_dir)
            write_gguf(
                target,
                ckpt=ckpt,
                cfg=plan.config,
                layout=plan.layout,
                plan=plan.quant,
                vocab=vocab,
                name=plan.name,
                imatrix=imatrix,
            )
            ckpt.close()
            check_types(target, plan.quant)
            write_s = time.perf_counter() - t0
            parity = self._verify(req, plan, target, tmp, vocab, console) if req.verify else None
            files = {fname: target} | ({imatrix_file.name: imatrix_file} if imatrix_file else {})
            manifest = manifest_base("gguf", plan, files, fname)
            if imatrix is not None:
                manifest["imatrix"] = imatrix_record(imatrix, imatrix_file, by_ggml(plan.quant, True))
            if allocation is not None:
                manifest["allocation"] = {
                    "budget": allocation.budget,
                    "tensor_bytes": allocation.total_bytes,
                    "pinned_bytes": allocation.fixed_bytes,
                    "upgrades": len(allocation.steps),
                    "banks": allocation.table(),
                }
            manifest |= {
                "llama_cpp_arch": plan.layout.arch,
                "notes": plan.layout.notes + vocab.notes + manifest["notes"],
                "parity": parity.to_json() if parity is not None else NOT_VERIFIED,
                "timing_s": {"write": round(write_s, 3), "total": round(time.perf_counter() - t0, 3)},
            }
            write_manifest(tmp, manifest)
        return manifest

    def _verify(
        self, req: ExportRequest, plan: GGUFPlan, target: Path, tmp: Path, vocab: Any, console: Console | None
    ) -> ParityRecord:
        """The parity record of the written GGUF (llama.cpp against transformers), gated by the plan's kind: a float
        plan's conversion is held to its max |Δlogit| tolerance, every plan to the margin gate.

        Raises:
            ExportError: a gate is missed or the tokenizers disagree.
        """
        from moetool.export.gguf.verify import compare
        from moetool.export.reference import reference_dtype, stream_reference

        text, text_src = held_out_text(req.model_dir, req.eval_text)
        lossless = all(a.type == "f32" for a in plan.quant.assignments)
        ref = reference_dtype(plan.quant.total_params, plan.config)
        streamed = stream_reference(plan.quant.total_params, plan.config)
        if streamed and console is not None:
            console.print(
                "verifying with the transformers models streamed from disk one layer at a time: the model in "
                f"{ref} does not fit in the memory available"
            )
        # inside the output's own temporary folder, not $TMPDIR: a killed run's full-size copy of the weights is
        # swept with the rest of that folder by the next run (io.atomic), and it lands on the output's filesystem,
        # whose free space the output needs anyway
        held = artifact_dtype(ref, plan.quant)
        with tempfile.TemporaryDirectory(prefix=".parity-", dir=tmp) as work:
            own: ArtifactWeights | ArtifactTensors | None = None
            if streamed and not lossless:  # dequantized as each layer is read: a model too big for memory is too
                own = ArtifactTensors(target, req.model_dir, plan.layout)  # big for a second copy on the disk
            elif not lossless:
                own = artifact_checkpoint(target, req.model_dir, plan.layout, Path(work), dtype=held)
            try:
                report = compare(
                    target,
                    req.model_dir,
                    text,
                    artifact_weights=own.path if isinstance(own, ArtifactWeights) else own,
                    equivalent=functools.partial(llama_cpp_equivalent, vocab),
                    dtype=ref,
                    artifact_dtype="float32" if isinstance(own, ArtifactTensors) else held,
                    types=matrix_types(plan.quant),
                    rounding=own.rounding if own else None,
                    streamed=streamed,
                )
            finally:
                if isinstance(own, ArtifactTensors):
                    own.close()
        tolerance = gate_problems(report, plan.quant)
        return replace(report.record(), text=text_src, tolerance=tolerance, verdict="pass")

    def _imatrix(
        self, req: ExportRequest, plan: GGUFPlan, given: ImportanceMatrix | None, path: Path, console: Console | None
    ) -> tuple[ImportanceMatrix, Path]:
        """The importance matrix to quantize with (given, or collected now), written beside the GGUF."""
        if given is None:
            from moetool.export.gguf.imatrix import collect

            assert req.imatrix is not None and not isinstance(req.imatrix, Path)
            names = {t.name for t in plan.layout.tensors if len(t.shape) >= 2}
            given = collect(req.model_dir, req.imatrix, names, console=console)
        weighted = by_ggml(plan.quant, True)
        starved = given.starved(weighted)
        if starved:
            name, experts = next(iter(starved.items()))
            raise ImatrixError(
                f"the importance matrix has no data for expert(s) {experts} of {name} ({len(starved)} tensor(s) so): "
                f"llama.cpp would quantize them with no importance; collect with --imatrix auto (every expert gets "
                f"tokens) or a calibration text that reaches them"
            )
        bare = sorted(n for n, t in weighted.items() if t in NEEDS_IMATRIX and n not in given.entries)
        if bare:
            raise ImatrixError(
                f"{bare[0]} ({len(bare)} tensor(s) so) is planned as {plan.quant.type_of(bare[0])} but the importance "
                f"matrix has no statistics for it (llama.cpp collects none for a token lookup table): give it a type "
                f"of 4 bits or more in --quant, e.g. embeddings=q8_0"
            )
        given.save(path)
        return given, path


def _role(e: TensorEntry) -> str | None:
    try:
        return e.role or role_of(e.hf_name)
    except ValueError:
        return None


def allocate_plan(
    req: ExportRequest, plan: GGUFPlan, imatrix: ImportanceMatrix, calib: Calibration, console: Console | None
) -> Allocation:
    """Measure every unpinned tensor's sensitivity and give it the type the budget earns it; ``plan.quant`` becomes
    the allocated plan (the user's rules, and f32 routers, stay as they were).

    Raises:
        ExportError: the budget is below the cheapest plan.
    """
    from moetool.export.gguf.allocate import measure_cached

    budget = req.quant.budget
    assert budget is not None
    _, rules = plan.quant.spec.effective()
    banks: dict[str, str] = {}
    fixed = 0
    for a in plan.quant.assignments:
        name = a.entry.out_name or a.entry.hf_name
        pinned = a.role == "router" or len(a.entry.shape) < 2 or any(r.matches(a.entry.names, a.role) for r in rules)
        if pinned:
            fixed += a.nbytes
        else:
            banks[name] = a.role
    measured = measure_cached(req.model_dir, calib, imatrix, banks, console=console)
    try:
        alloc = allocate(measured, budget, fixed)
    except BudgetTooSmall as exc:
        raise ExportError(f"--quant budget={budget}: {exc}") from None
    exact = [QuantRule(match=n, type=t) for n, t in alloc.types.items()]
    spec = plan.quant.spec.model_copy(update={"rules": [*exact, *plan.quant.spec.rules]})
    plan.quant = resolve(spec, [a.entry for a in plan.quant.assignments], cannot=_ROUTER_K)
    return alloc


def imatrix_record(m: ImportanceMatrix, path: Path | None, llama: dict[str, str]) -> dict[str, Any]:
    """The manifest's account of the importance matrix: its file, how it was collected, and the tokens each expert
    of each layer saw."""
    from moetool.export.gguf.imatrix import expert_token_table

    info = m.info or {}
    return {
        "file": path.name if path else None,
        "datasets": m.datasets,
        "chunks": m.chunk_count,
        "chunk_size": m.chunk_size,
        "mode": info.get("mode"),
        "min_tokens": info.get("min_tokens"),
        "source": info.get("source"),
        "tokens": info.get("tokens"),
        "forced": info.get("forced"),
        "tensors_weighted": sorted(n for n in llama if n in m.entries),
        "expert_tokens": expert_token_table(m),
    }


def gguf_need(plan: GGUFPlan, *, verify: bool, output: Path, collect: bool = False) -> Need:
    """Memory and disk of writing (and verifying) ``plan``'s GGUF, from the plan alone.

    Disk: the artifact and, for a lossy plan verified with the model held, the float32 checkpoint of the artifact's
    dequantized weights that verification compares layer outputs with (streamed, they are dequantized as read).
    Memory: writing streams one tensor at a time; verification holds one float32 copy of the weights at a time (the
    source model beside llama.cpp's copy of the artifact, then the artifact's dequantized weights).
    """
    from moetool.compute.upcast import float32_overhead
    from moetool.export.reference import VERIFY_OVERHEAD, reference_dtype, stream_reference, streamed_need

    params = plan.quant.total_params
    artifact = plan.quant.total_bytes
    lossy = any(a.type != "f32" for a in plan.quant.assignments)
    ref = reference_dtype(params, plan.config)
    streamed = verify and stream_reference(params, plan.config)
    # the source's weights as the reference holds them, then the artifact's dequantized ones (on disk too)
    held = params * (4 if ref == "float32" else 2)
    ref_bytes = held if ref == "float32" else held + float32_overhead(params, plan.config)
    own = plan.config.get("dtype") or plan.config.get("torch_dtype")
    own_bytes = params * (2 if own in ("bfloat16", "float16") else 4)  # the calibration loads the model as it is
    disk = artifact + (held if verify and lossy and not streamed else 0)  # streamed: dequantized as read
    # llama.cpp runs first and lets its copy go; then one transformers model at a time, in the reference's dtype;
    # streamed, one layer of it (llama.cpp maps the file: its pages are the page cache's, not the process's own)
    verifying = streamed_need(params, plan.config) if streamed else max(ref_bytes, artifact) + VERIFY_OVERHEAD
    memory = max(verifying if verify else VERIFY_OVERHEAD, own_bytes + VERIFY_OVERHEAD if collect else 0)
    detail = f"the model held in {ref}, one copy at a time"
    if streamed:
        detail = f"the model in {ref} does not fit: streamed from disk, one float32 layer at a time"
    return Need(
        stage=f"GGUF export ({plan.quant.label})",
        memory=memory,
        memory_detail=f"verification: {detail}" if verify else "writing",
        disk=disk,
        output=output,
        way_out="Export with --no-verify (the artifact is not checked), or on a machine with more memory",
    )


def check_types(path: Path, plan: QuantPlan) -> None:
    """The written file must hold exactly the planned type for every tensor (catches quantizer overrides)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    got = {t.name: t.tensor_type.name.lower() for t in reader.tensors}
    want = {(a.entry.out_name or a.entry.hf_name): a.type for a in plan.assignments}
    wrong = {n: (want.get(n), got.get(n)) for n in set(got) | set(want) if got.get(n) != want.get(n)}
    if wrong:
        sample = ", ".join(f"{n}: planned {w}, file {g}" for n, (w, g) in sorted(wrong.items())[:4])
        raise ExportError(f"{path.name}: tensor types differ from the plan ({len(wrong)}): {sample}")


def artifact_dtype(reference: str, plan: QuantPlan) -> str:
    """The dtype the artifact's dequantized weights are held in for the conversion check: the reference's float32,
    or, for a 16-bit reference, one that holds the plan's float types exactly: float16 (three more bits than bf16 for
    the dequantized blocks) unless a tensor is bf16."""
    if reference == "float32":
        return reference
    return "bfloat16" if any(a.type == "bf16" for a in plan.assignments) else "float16"


def matrix_types(plan: QuantPlan) -> set[str]:
    """The types of the plan's matrices (vectors stay f32 in every plan and round nothing)."""
    return {a.type for a in plan.assignments if len(a.entry.shape) >= 2}


def gate_problems(report: ParityReport, plan: QuantPlan) -> float | None:
    """Raise when the artifact misses its gates: the tokenizer disagrees, a float plan's conversion differs by more
    than its max |Δlogit| gate, or the margin gate (:mod:`moetool.export.gate`) fails; else return the max |Δlogit|
    tolerance the conversion was held to (None for a quantized plan, which the margin gate judges).

    Raises:
        ExportError: a gate is missed.
    """
    if not report.tokenizer_match:
        bad = report.tokenizer_mismatches[0]
        raise ExportError(
            f"llama.cpp tokenizes differently from the Hugging Face tokenizer on {len(report.tokenizer_mismatches)} "
            f"probe(s), e.g. {bad['text']!r}: HF {bad['hf'][:12]} vs llama.cpp {bad['llama_cpp'][:12]}"
        )
    types = matrix_types(plan)
    kind = next((k for k, allowed in _FLOAT_KINDS if types <= allowed), None)
    worst = max(report.conversion.max_abs_logit_diff.values())
    if kind is not None and worst > GATES[kind]:  # the reference holds a float plan's weights exactly
        raise ExportError(
            f"parity failed: max |Δlogit| {worst:.3g} > {GATES[kind]:g} for a {kind} plan (llama.cpp vs transformers "
            f"on the artifact's own weights, seq {report.seq_lens})"
        )
    if report.gate is not None and not report.gate.passed:
        raise ExportError(
            f"parity failed: {'; '.join(report.gate.problems)} (llama.cpp vs the transformers float32 reference; "
            f"raw top-1 {report.gate.raw_top1:.3f})"
        )
    return GATES[kind] if kind is not None else None


_FLOAT_KINDS = (("f32", {"f32"}), ("f16", {"f32", "f16"}), ("bf16", {"f32", "bf16"}))
