"""Export a routed-embedding model through standard graph ops.

``ExportRoutedLM`` is the routed embedding (router MHA, softmax, LayerNorm, matmuls) in front of the graph
exporters' body (:class:`moetool.export.graph.model.ExportLM`'s blocks), with every cache explicit:
``forward(input_ids [B, T], position_ids [B, T], mask [B, 1, T, P+T], *past) -> (logits [B, T, V], *present)``,
``past`` = the router's tensors (k, v [B, heads, P, hd] per router layer, then cross k, v [B, P, d_r]) followed by the
body's (k, v [B, kv_heads, P, head_dim] per layer). One mask serves the router and the body.

- ``onnx``: a prefill graph and a decode-step graph (torch.onnx, dynamo), checked in onnxruntime against the
  transformers-side model with the graph exporters' parity (two prefill lengths, cached decode, top-1 agreement and
  perplexity on held-out windows); fp32 only, gated at 1e-4.
- ``coreml``: the prefill program (ML Program, fp32, flexible length) converted with coremltools and checked
  structurally (inputs, outputs, op histogram); Core ML cannot run on Linux, so the numeric proof is the converted
  torch wrapper against transformers at two lengths. The cached decode graph is not converted for Core ML yet.
- ``tflite``: the prefill over a fixed, right-padded length (litert-torch in ``.venv-litert``, through
  :mod:`.tflite_worker`), checked in the LiteRT interpreter against transformers at two lengths (gated at 1e-4);
  no decode signature (the router cache would need a static-capacity form).
- ``gguf``: refused: llama.cpp has no architecture for an input embedding computed by a causal network.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

import copy
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from moetool.export.base import ExportError, manifest_fields, write_manifest
from moetool.export.graph.common import onnx_export
from moetool.export.graph.model import ExportLM
from moetool.export.graph.parity import judge, measure_graph
from moetool.export.heldout import held_out_text, windows
from moetool.export.parity import ParityRecord, parity_of
from moetool.export.tflite.runner import run_worker
from moetool.extras import require
from moetool.io.atomic import atomic_dir, check_output
from moetool.io.jsontypes import JsonObject
from moetool.methods.embedding.model import MODEL_TYPE, RoutedEmbeddingForCausalLM
from moetool.methods.embedding.router import causal_mask
from moetool.methods.embedding.variants import measured_counts

TARGETS = ("onnx", "coreml", "tflite", "gguf")
GGUF_MESSAGE = (
    "gguf: llama.cpp has no architecture whose input embedding is computed by a causal network over the prefix "
    "(a routed embedding needs a router with its own KV cache before the first layer); no faithful mapping to an "
    "existing GGUF architecture exists. Export to onnx instead"
)


class ExportRoutedLM(nn.Module):
    """Routed embedding + the graph exporters' body, caches as inputs and outputs (see the module docstring)."""

    def __init__(self, model: RoutedEmbeddingForCausalLM) -> None:
        super().__init__()

        body = model.body
        d = body.config.hidden_size
        head = model.lm_head.weight if model.lm_head is not None else torch.zeros(1, d)
        shim = SimpleNamespace(  # what ExportLM reads from a transformers causal LM
            config=body.config,
            model=SimpleNamespace(
                embed_tokens=nn.Embedding(1, d), layers=body.layers, norm=body.norm, rotary_emb=body.rotary_emb
            ),
            lm_head=SimpleNamespace(weight=head),
        )
        core = ExportLM(shim)
        self.core = core  # its 1-row embed (and, when tied, 1-row head) placeholders are never called
        self.tied = model.lm_head is None
        self.embed = copy.deepcopy(model.embed).eval()
        self.embed.compute_aux = False
        self.n_router = self.embed.n_cache
        self.n_layers, self.n_kv, self.head_dim = core.n_layers, core.n_kv, core.head_dim

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        rpast, bpast = past[: self.n_router], past[self.n_router :]
        x, rpresent, _ = self.embed(input_ids, position_ids, mask, tuple(rpast))
        core = self.core
        cos, sin = core.rope(position_ids, x.dtype)  # [B, 1, T, hd]: the body's rope, scaled as transformers scales it
        present: list[torch.Tensor] = list(rpresent)
        for i, block in enumerate(core.layers):
            x, k, v = block(x, cos, sin, mask, bpast[2 * i] if bpast else None, bpast[2 * i + 1] if bpast else None)
            present += [k, v]
        h = core.norm(x)
        # tied: the seed table through the projection, never materialised as V×D
        logits = (h @ self.embed.proj.weight) @ self.embed.table.weight.T if self.tied else core.lm_head(h)
        return (logits, *present)

    def past_names(self, kind: str) -> list[str]:
        layers = self.embed.router.cfg.layers if self.embed.router is not None else 0
        router = [f"{kind}.router.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
        if self.n_router > len(router):
            router += [f"{kind}.router.cross.key", f"{kind}.router.cross.value"]
        body = [f"{kind}.{i}.{kv}" for i in range(self.n_layers) for kv in ("key", "value")]
        return router[: self.n_router] + body

    def empty_past(self, p: int) -> list[torch.Tensor]:
        """Zero caches of ``p`` positions (a tracing example)."""
        out: list[torch.Tensor] = []
        r = self.embed.router
        if r is not None:
            w, h = r.cfg.width, r.cfg.heads
            out += [torch.zeros(1, h, p, w // h) for _ in range(2 * r.cfg.layers)]
            if r.cross:
                out += [torch.zeros(1, p, w), torch.zeros(1, p, w)]
        return out + [torch.zeros(1, self.n_kv, p, self.head_dim) for _ in range(2 * self.n_layers)]

    def past_shapes(self, dim: torch.export.Dim) -> tuple[dict[int, torch.export.Dim], ...]:
        """Dynamic-shape spec of the past inputs: the position axis of each cache tensor."""
        n_cross = self.n_router - 2 * (self.embed.router.cfg.layers if self.embed.router is not None else 0)
        router = [{2: dim} for _ in range(self.n_router - n_cross)] + [{1: dim} for _ in range(n_cross)]
        return tuple(router + [{2: dim} for _ in range(2 * self.n_layers)])


def export_onnx(
    model: RoutedEmbeddingForCausalLM, tok: PreTrainedTokenizerBase, text: str, out_dir: Path, *, text_source: str
) -> JsonObject:
    """Write ``model.onnx`` + ``model-with-past.onnx`` into ``out_dir`` and return the parity figures."""

    for module in ("onnx", "onnxscript"):  # onnxscript: torch.onnx's dynamo exporter
        require(module, "onnx", why="ONNX export")
    ort = require("onnxruntime", "onnx", why="ONNX export")
    em = ExportRoutedLM(model).eval()
    pre, dec = out_dir / "model.onnx", out_dir / "model-with-past.onnx"
    max_pos = int(model.embed.cfg.max_positions)
    seq = torch.export.Dim("seq", min=2, max=max_pos)
    ids = torch.randint(0, 10, (1, 8))
    names_in, names_out = ["input_ids", "position_ids", "mask"], ["logits", *em.past_names("present")]
    with torch.no_grad():
        args: tuple[torch.Tensor, ...] = (ids, torch.arange(8)[None], causal_mask(8, 0))
        shapes: tuple[object, ...] = ({1: seq}, {1: seq}, {2: seq, 3: seq})
        onnx_export(em, args, pre, inputs=names_in, outputs=names_out, dynamic_shapes=shapes)
        p = 5
        past = em.empty_past(p)
        plen = torch.export.Dim("past", min=1, max=max_pos - 1)
        args = (ids[:, :1], torch.tensor([[p]]), causal_mask(1, p), *past)
        shapes = (None, None, {3: plen + 1}, em.past_shapes(plen))
        names = [*names_in, *em.past_names("past")]
        onnx_export(em, args, dec, inputs=names, outputs=names_out, dynamic_shapes=shapes)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s_pre = ort.InferenceSession(str(pre), so, providers=["CPUExecutionProvider"])
    s_dec = ort.InferenceSession(str(dec), so, providers=["CPUExecutionProvider"])
    past_names = em.past_names("past")

    def prefill(x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        t = x.shape[1]
        feeds = {"input_ids": x, "position_ids": np.arange(t, dtype=np.int64)[None], "mask": causal_mask(t, 0).numpy()}
        out = s_pre.run(None, feeds)
        return out[0], out[1:]

    def decode(x: np.ndarray, pos: int, cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {"input_ids": x, "position_ids": np.array([[pos]], dtype=np.int64), "mask": causal_mask(1, pos).numpy()}
        feeds |= dict(zip(past_names, cache, strict=True))
        out = s_dec.run(None, feeds)
        return out[0], out[1:]

    lens = (32, min(128, max_pos))
    record = measure_graph(
        model, em, tok, text, prefill, decode, runtime=f"onnxruntime {ort.__version__}", seq_lens=lens
    )
    parity = judge(replace(record, text=text_source), "ONNX (fp32)")
    ops: dict[str, int] = {}
    import onnx

    for n in onnx.load(str(pre)).graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])
    return {
        "parity": parity.to_json(),
        "ops": {op: n for op, n in ranked},
        "runtime": f"onnxruntime {ort.__version__}",
    }


class PrefillLogits(nn.Module):
    """Logits only, no caches: what the Core ML program computes."""

    def __init__(self, em: ExportRoutedLM) -> None:
        super().__init__()
        self.em = em

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.em(input_ids, position_ids, mask)[0]
        return result


def export_coreml(
    model: RoutedEmbeddingForCausalLM, tok: PreTrainedTokenizerBase, text: str, out_dir: Path, *, text_source: str
) -> JsonObject:
    """Write ``model.mlpackage`` (prefill) into ``out_dir``; return the structural check and the wrapper's parity."""
    from collections import Counter

    ct = require("coremltools", "coreml", why="Core ML export")
    em = ExportRoutedLM(model).eval()
    wrapper = PrefillLogits(em).eval()
    max_pos = int(model.embed.cfg.max_positions)
    example = (torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], causal_mask(8, 0))
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, example)
    seq = ct.RangeDim(2, max_pos)
    ml = ct.convert(
        traced,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS17,
        inputs=[
            ct.TensorType(name="input_ids", shape=(1, seq), dtype=np.int32),
            ct.TensorType(name="position_ids", shape=(1, seq), dtype=np.int32),
            ct.TensorType(name="mask", shape=(1, 1, seq, seq), dtype=np.float32),
        ],
        outputs=[ct.TensorType(name="logits", dtype=np.float32)],
        compute_precision=ct.precision.FLOAT32,
        skip_model_load=True,
    )
    ml.save(str(out_dir / "model.mlpackage"))
    spec = ml.get_spec()
    ops = Counter(
        op.type
        for f in spec.mlProgram.functions.values()
        for b in f.block_specializations.values()
        for op in b.operations
    )
    inputs = [i.name for i in spec.description.input]
    outputs = [o.name for o in spec.description.output]
    if inputs != ["input_ids", "position_ids", "mask"] or outputs != ["logits"]:
        raise ExportError(f"coreml: unexpected program signature {inputs} -> {outputs}")
    lens = [32, min(128, max_pos)]
    probes, _ = windows(tok, text, lens, 1)
    diffs = {}
    for ids in probes:
        x = torch.tensor([ids])
        with torch.no_grad():
            diffs[str(len(ids))] = float(
                (wrapper(x, torch.arange(len(ids))[None], causal_mask(len(ids), 0)) - model(x).logits).abs().max()
            )
    if max(diffs.values()) > 1e-4:
        raise ExportError(f"coreml: the converted wrapper differs from transformers by {max(diffs.values()):.3g}")
    # the converted wrapper is what is held to 1e-4 here (the program itself cannot run off Apple platforms)
    parity = ParityRecord(
        runtime="none on Linux (Core ML runs on Apple platforms only)",
        text=text_source,
        tolerance=1e-4,
        verdict="pass",
        extra={"converted_wrapper_vs_transformers": dict(diffs)},
    )
    return {
        "parity": parity.to_json(),
        "ops": dict(ops.most_common()),
        "runtime": f"coremltools {ct.__version__}",
        "spec_version": spec.specificationVersion,
        "inputs": inputs,
        "outputs": outputs,
    }


def export_tflite(model_dir: Path, text: str, out_dir: Path, *, text_source: str) -> JsonObject:
    """Run :mod:`.tflite_worker` in the litert-torch interpreter; returns its figures (parity gated at 1e-4).

    Raises:
        ExportError: the worker reported no parity, or it is over 1e-4.
    """

    request = {"model_dir": str(model_dir), "out_dir": str(out_dir), "prefill_len": 128, "eval_text": text}
    result: JsonObject = run_worker("moetool.methods.embedding.tflite_worker", request)
    record = parity_of(result.get("parity"))
    if not isinstance(record, ParityRecord):
        raise ExportError(f"TFLite: the conversion worker reported no parity figures: {result.get('parity')!r}")
    result["parity"] = judge(replace(record, text=text_source), "TFLite (fp32)").to_json()
    result["runtime"] = "LiteRT (ai_edge_litert interpreter)"
    return result


def export_routed(
    model_dir: Path, target: str, output: Path, *, force: bool = False, eval_text: str | None = None
) -> JsonObject:
    """Export the routed-embedding model in ``model_dir`` to ``target``; writes ``output`` atomically with a
    manifest (the fields every export's has, so ``moetool package`` takes it) and returns it.

    Raises:
        ExportError: an unknown or unsupported target (gguf), a model of another type, or failed parity.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if target == "gguf":
        raise ExportError(GGUF_MESSAGE)
    if target not in TARGETS:
        raise ExportError(
            f"target {target!r}: routed-embedding models export to onnx or coreml (not gguf, not yet tflite)"
        )
    model_dir = Path(model_dir)
    try:
        cfg = AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ExportError(f"{model_dir}: not a model directory: {exc}") from None
    if cfg.model_type != MODEL_TYPE:
        raise ExportError(f"{model_dir}: model_type {cfg.model_type!r} is not {MODEL_TYPE!r}; use `moetool export`")
    check_output(output, force=force)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if not isinstance(model, RoutedEmbeddingForCausalLM):
        raise ExportError(f"{model_dir}: loads as {type(model).__name__}, not a routed-embedding model")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text, source = held_out_text(model_dir, eval_text)
    t0 = time.perf_counter()
    with atomic_dir(output, force=force) as tmp:
        if target == "onnx":
            result = export_onnx(model, tok, text, tmp, text_source=source)
            main, graphs = "model.onnx", {"prefill": "model.onnx", "decode_step": "model-with-past.onnx"}
        elif target == "coreml":
            result = export_coreml(model, tok, text, tmp, text_source=source)
            main, graphs = "model.mlpackage", {"prefill": "model.mlpackage"}
        else:
            result = export_tflite(model_dir, text, tmp, text_source=source)
            main, graphs = "model.tflite", {"prefill": "model.tflite (signature prefill, 128 tokens right-padded)"}
        manifest: JsonObject = {
            "format": "moetool-embedding-artifact/1",
            "model_type": MODEL_TYPE,
            "variant": model.embed.cfg.variant,
            "head": model.config.head,
            "precision": "fp32",
            "graphs": dict(graphs),
            "routed_embedding_params": dict(measured_counts(model.embed)),
            "cache_inputs": list(ExportRoutedLM(model).past_names("past")),
            **result,
            "timing_s": {"total": round(time.perf_counter() - t0, 3)},
            "notes": ["weights fp32 (no MatMulNBits quantization of the router yet)"],
        }
        manifest |= manifest_fields(tmp, model_dir, main, target=target, model_type=MODEL_TYPE)
        write_manifest(tmp, manifest)
    return manifest
