"""GEM export.

Token level (``moetool_gem`` checkpoint) → ONNX: one prefill graph with the router, the threshold rule and the
pathway choice inside it (``gem.onnx``: input_ids [1, T], position_ids [1, T], mask [1, 1, T, T] → logits
[1, T, V], router_probs [1, T, n], routes [1, T] int64, 0 = general; the graph is
:class:`~moetool.methods.gem.export_graph.GemGraph`). Parity in onnxruntime against the PyTorch model at two
sequence lengths on held-out text of every domain (:mod:`moetool.methods.gem.export_parity`). No KV-cache graph: the
token-level model has no cache (each call is a full prefill). → TFLite: the same graph at a static length, converted
by litert-torch in its own interpreter (:mod:`moetool.export.tflite.runner`). Core ML is not offered for it.

Sequence level (bundle from ``moetool merge``) → ``router.onnx`` (encoder layers + mean pool + W_r + softmax + rule
→ router_probs [1, n], route [1]) and one artifact per pathway through the regular exporters (any target, each
with its own parity check), with the ``manifest.json`` that :mod:`moetool.methods.gem.dispatch` follows.

Every manifest is ``manifest.json`` with the fields every export has (:func:`~moetool.export.base.manifest_fields`),
beside GEM's own, so ``moetool package`` (and ``moetool build``) take GEM artifacts like the standard ones.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from moetool.errors import MoetoolError
from moetool.export.base import MANIFEST, manifest_fields, write_manifest
from moetool.export.bundle import Bundle, Member, MemberArtifact, export_bundle
from moetool.export.onnx.quantize import quantize_graph, save_model
from moetool.export.parity import ParityRecord, RouteCheck, parity_of
from moetool.export.tflite.runner import litert_python, run_worker
from moetool.extras import require
from moetool.io.atomic import atomic_dir
from moetool.io.files import copy_tokenizer
from moetool.io.hashes import sha256_file
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.io.safe import read_json
from moetool.methods.gem.evaluate import SequenceGem
from moetool.methods.gem.export_graph import GemGraph, RouterGraph, graph_precisions, trace_onnx
from moetool.methods.gem.export_parity import (
    PARITY_LIMIT,
    SEQ_LENS,
    gated,
    probe_windows,
    router_parity,
    token_parity,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from moetool.methods.gem.model import GemForCausalLM

__all__ = [
    "MANIFEST",
    "PARITY_LIMIT",
    "SEQ_LENS",
    "GemGraph",
    "RouterGraph",
    "export_sequence_bundle",
    "export_token_onnx",
    "export_token_tflite",
    "graph_precisions",
    "token_parity",
    "trace_graph",
]

FORMAT = "moetool-gem-artifact/1"
RULE = "routes = argmax+1 where max router_probs > tau (strict) else 0 (general); inside the graph"


def require_onnx(why: str, *, verify: bool) -> None:
    """Refuse once, before any model is loaded, when the ONNX extra is missing: tracing needs onnx and onnxscript
    (torch.onnx's dynamo exporter), the parity check onnxruntime."""
    for module in ("onnx", "onnxscript", *(("onnxruntime",) if verify else ())):
        require(module, "onnx", why=why)


def trace_graph(graph: GemGraph, path: Path) -> None:
    """The token graph to ONNX (see :func:`~moetool.methods.gem.export_graph.trace_onnx`)."""
    trace_onnx(graph, path, ["logits", "router_probs", "routes"])


def _token_manifest(
    target: str, path: Path, model_dir: Path, cfg: PretrainedConfig, fields: JsonObject, t0: float
) -> JsonObject:
    """What both token-level manifests hold around the target's own ``fields`` (inputs, outputs, parity, …): GEM's
    figures and the fields every manifest has (the folder's files, the model's weights), written as manifest.json.

    ``path`` is the graph inside the temporary folder, which holds everything else already (the tokenizer)."""

    manifest: JsonObject = {
        "format": FORMAT,
        "level": "token",
        "domains": [str(d) for d in cfg.domains],
        "tau": float(cfg.tau),
        "rule": RULE,
        **fields,
        "scar_clusters": int(cfg.scar_clusters),
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
        "timing_s": round(time.perf_counter() - t0, 2),
    }
    manifest |= manifest_fields(path.parent, model_dir, path.name, target=target, model_type=cfg.model_type)
    write_manifest(path.parent, manifest)
    return manifest


def _load_token_model(model_dir: Path) -> GemForCausalLM:
    from transformers import AutoModelForCausalLM

    from moetool.methods.gem.model import GemForCausalLM  # registers its model class

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if not isinstance(model, GemForCausalLM):
        raise MoetoolError(
            f"{model_dir}: not a token-level moetool_gem checkpoint (model_type "
            f"{model.config.model_type!r}); a sequence-level bundle exports with the same command"
        )
    return model


def export_token_onnx(
    model_dir: Path, output: Path, *, quant: str | None = None, force: bool = False, verify: bool = True
) -> JsonObject:
    """``gem.onnx`` + ``manifest.json`` (+ tokenizer) into ``output`` atomically.

    ``quant`` (e.g. ``gem``: pathways int4, router and general layers int8) quantizes MatMul weights with
    onnxruntime's MatMulNBits; fp32 parity is gated (1e-4), a quantized graph's figures are reported.
    """
    from transformers import AutoTokenizer

    require_onnx("the token-level GEM ONNX export", verify=verify)
    model = _load_token_model(model_dir)
    graph = GemGraph(model).eval()
    precisions = graph_precisions(graph, quant)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    t0 = time.perf_counter()
    with atomic_dir(output, force=force) as tmp:
        path = tmp / "gem.onnx"
        trace_graph(graph, path)
        counts: dict[str, int] = {}
        notes: list[str] = []
        if any(p != "fp32" for p in precisions.values()):
            counts, notes = quantize_graph(path, precisions)
        else:
            _strip_metadata(path)
        parity: JsonValue = "not verified"
        if verify:
            record = gated(token_parity(model, path, probe_windows(tok, model_dir, SEQ_LENS)), quantized=bool(counts))
            if record.verdict == "fail":
                raise MoetoolError(f"gem ONNX parity failed: {record.to_json()}")
            parity = record.to_json()
        tok.save_pretrained(str(tmp))
        fields: JsonObject = {
            "inputs": {
                "input_ids": "[1, T] int64",
                "position_ids": "[1, T] int64 (0..T-1)",
                "mask": "[1, 1, T, T] float32 additive causal mask (0 / -1e9)",
            },
            "outputs": {"logits": "[1, T, V]", "router_probs": "[1, T, n_domains]", "routes": "[1, T] int64"},
        }
        fields |= {"quant": quant or "f32", "quantized_nodes": dict(counts), "notes": list(notes), "parity": parity}
        manifest = _token_manifest("onnx", path, model_dir, model.config, fields, t0)
    return manifest


def export_token_tflite(
    model_dir: Path, output: Path, *, force: bool = False, verify: bool = True, capacity: int = 128
) -> JsonObject:
    """``gem.tflite`` (fp32, static length ``capacity``, router and rule inside) + manifest, converted by litert-torch
    in its own venv (moetool.methods.gem.tflite_worker); parity in the LiteRT interpreter gated like ONNX."""
    from transformers import AutoConfig, AutoTokenizer

    import moetool.methods.gem.model  # noqa: F401  (registers its model class)

    cfg = AutoConfig.from_pretrained(str(model_dir))
    if cfg.model_type != "moetool_gem":
        raise MoetoolError(f"{model_dir}: not a token-level moetool_gem checkpoint")
    capacity = min(capacity, int(cfg.max_position_embeddings))
    litert_python()  # no litert-torch: refuse before anything is written
    t0 = time.perf_counter()
    with atomic_dir(output, force=force) as tmp:
        request = {"model_dir": str(model_dir), "out_dir": str(tmp), "capacity": capacity, "verify": verify}
        result = run_worker("moetool.methods.gem.tflite_worker", request, what="gem TFLite conversion")
        parity: JsonValue = "not verified"
        record = parity_of(result.get("parity"))
        if isinstance(record, ParityRecord):
            record = gated(record, quantized=False)
            if record.verdict == "fail":
                raise MoetoolError(f"gem TFLite parity failed: {record.to_json()}")
            parity = record.to_json()
        AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(tmp))
        fields: JsonObject = {
            "capacity": capacity,
            "inputs": {
                "args_0": f"[1, {capacity}] int32 ids, right-padded",
                "args_1": f"[1, {capacity}] int32 positions",
                "args_2": f"[1, 1, {capacity}, {capacity}] float32 additive causal mask",
            },
            "outputs": {"output_0": "logits", "output_1": "router_probs", "output_2": "routes (int32, 0 = general)"},
        }
        manifest = _token_manifest("tflite", tmp / "gem.tflite", model_dir, cfg, fields | {"parity": parity}, t0)
    return manifest


def _strip_metadata(path: Path) -> None:
    """Drop trace metadata (stack traces with local paths) and re-save: one file, or external data past 2 GB."""
    import onnx

    m = onnx.load(str(path))
    for node in m.graph.node:
        del node.metadata_props[:]
    save_model(m, path)


def _export_router(bundle: Path, seq: SequenceGem, graph: RouterGraph, path: Path, *, verify: bool) -> JsonObject:
    """``router.onnx`` at ``path``; with ``verify`` its parity, gated (same decisions, |ΔP| ≤ 1e-5)."""
    trace_onnx(graph, path, ["router_probs", "route"])
    _strip_metadata(path)
    if not verify:
        return {}
    from transformers import AutoTokenizer

    probes = probe_windows(AutoTokenizer.from_pretrained(str(bundle)), bundle, SEQ_LENS)
    parity = router_parity(seq, path, probes)
    routes = parity.routes or RouteCheck()
    if (routes.max_abs_prob_diff or 0.0) > 1e-5 or routes.same_route != len(probes):
        raise MoetoolError(f"gem router ONNX parity failed: {parity.to_json()}")
    checked: JsonObject = replace(parity, verdict="pass").to_json()
    return checked


def export_sequence_bundle(
    bundle: Path,
    output: Path,
    *,
    target: str = "onnx",
    quant: str | None = None,
    force: bool = False,
    verify: bool = True,
    console: Console | None = None,
) -> JsonObject:
    """``router.onnx`` + ``pathways/<name>/`` (one artifact each via the regular exporter for ``target``) +
    ``manifest.json``, written atomically; the router graph's parity is gated (same decisions, |ΔP| ≤ 1e-5)."""

    # the router is router.onnx whatever --target the pathways take: without the extra no pathway is written either
    # (a bundle without its router cannot dispatch), so refuse once, up front, saying why
    require_onnx(f"the sequence-level GEM router (router.onnx, written beside the {target} pathways)", verify=verify)
    from transformers import AutoTokenizer

    # plan_standard_export's default for a plain checkpoint is f16, which the graph targets do not store
    if quant is None and target != "gguf":
        quant = "f32"
    spec = read_json(bundle / "gem.json", what="GEM bundle spec")
    seq = SequenceGem(bundle)
    graph = RouterGraph(seq.pathways[0], spec["encoder"]["layers"], seq.router.weight, seq.router.bias, seq.tau).eval()
    t0 = time.perf_counter()

    def write_router(tmp: Path) -> JsonObject:
        parity = _export_router(bundle, seq, graph, tmp / "router.onnx", verify=verify)
        copy_tokenizer(bundle, tmp)
        return {
            "file": "router.onnx",
            "inputs": {
                "input_ids": "[1, T] int64",
                "position_ids": "[1, T] int64",
                "mask": "[1, 1, T, T] float32 additive causal mask",
            },
            "outputs": {"router_probs": "[1, n_domains]", "route": "[1] int64 (0 = general)"},
            "parity": parity,
        }

    def bundle_manifest(tmp: Path, router: JsonObject, artifacts: list[MemberArtifact]) -> JsonObject:
        return {
            "format": FORMAT,
            "level": "sequence",
            "domains": spec["domains"],
            "tau": seq.tau,
            "rule": "route = argmax+1 if max router_probs > tau (strict) else 0 (general); computed in router.onnx",
            "router": router,
            "route_names": seq.names,
            "pathways": {a.name: a.to_json() | {"file": a.path} for a in artifacts},  # relative to the bundle
            "tokenizer": "tokenizer.json",
            # the router was trained on BOS + the text's ids without special tokens: the dispatcher does the same
            "bos_token_id": AutoTokenizer.from_pretrained(str(bundle)).bos_token_id,
            "timing_s": round(time.perf_counter() - t0, 2),
        }

    members = [Member(n, bundle / spec["pathways"][n], f"pathways/{n}") for n in seq.names]
    return export_bundle(
        output, Bundle(members, target, quant, verify), source=bundle, router=write_router, manifest=bundle_manifest,
        force=force, console=console,
    )  # fmt: skip
