"""GEM export.

Token level (``moetool_gem`` checkpoint) → ONNX: one prefill graph with the router, the threshold rule and the
pathway choice inside it (``gem.onnx``: input_ids [1, T], position_ids [1, T], mask [1, 1, T, T] → logits
[1, T, V], router_probs [1, T, n], routes [1, T] int64, 0 = general). Every pathway's FFN runs on every token and
the one-hot route weights the sum (no data-dependent shapes), so the graph computes (n + 1) FFNs per token. With
SCAR the cluster assignment and the same-cluster mask are in the graph too. Parity in onnxruntime against the
PyTorch model at two sequence lengths on held-out text of every domain. No KV-cache graph: the token-level model has
no cache (each call is a full prefill). TFLite and Core ML are not offered for the token-level graph.

Sequence level (bundle from ``moetool merge``) → ``router.onnx`` (encoder layers + mean pool + W_r + softmax + rule
→ router_probs [1, n], route [1]) and one artifact per pathway through the regular exporters (any target, each
with its own parity check), with ``gem-manifest.json`` that :mod:`moetool.methods.gem.dispatch` follows.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moetool.errors import MoetoolError
from moetool.export.graph.model import NEG, RMSNorm, _linear, attend, causal_mask, qkv_rope
from moetool.io.atomic import atomic_dir

PARITY_LIMIT = 1e-4  # fp32 graph vs PyTorch, max |Δlogit|
SEQ_LENS = (32, 128)
MANIFEST = "gem-manifest.json"


class _FFN(nn.Module):
    def __init__(self, mlp: Any) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            _linear(mlp.gate_proj.weight),
            _linear(mlp.up_proj.weight),
            _linear(mlp.down_proj.weight),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Attn(nn.Module):
    """The attributes :func:`qkv_rope` / :func:`attend` read, from a transformers llama attention."""

    def __init__(self, attn: Any, cfg: Any) -> None:
        super().__init__()
        self.n_head = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads or self.n_head)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_head)
        self.q, self.k = _linear(attn.q_proj.weight), _linear(attn.k_proj.weight)
        self.v, self.o = _linear(attn.v_proj.weight), _linear(attn.o_proj.weight)
        self.q_norm = self.k_norm = None


class _Layer(nn.Module):
    def __init__(self, layer: Any, cfg: Any) -> None:
        super().__init__()
        eps = float(cfg.rms_norm_eps)
        self.attn_norm = RMSNorm(layer.input_layernorm.weight, eps)
        self.attn = _Attn(layer.self_attn, cfg)
        self.ffn_norm = RMSNorm(layer.post_attention_layernorm.weight, eps)
        self.mlp = _FFN(layer.mlp)
        self.pathways = nn.ModuleList([_FFN(p) for p in getattr(layer.mlp, "pathways", [])])


class GemGraph(nn.Module):
    """The token-level GEM model as a traceable graph: ``forward(input_ids, position_ids, mask)`` →
    (logits [B, T, V], router_probs [B, T, n], routes [B, T] int64)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        cfg = model.config
        gm = model.model
        self.tau = float(cfg.tau)
        self.encoder_layers = int(cfg.encoder_layers)
        self.embed = nn.Embedding.from_pretrained(gm.embed_tokens.weight.detach().clone(), freeze=True)
        self.layers = nn.ModuleList([_Layer(layer, cfg) for layer in gm.layers])
        self.norm = RMSNorm(gm.norm.weight, float(cfg.rms_norm_eps))
        self.lm_head = _linear(model.lm_head.weight)
        self.router = _linear(gm.router.weight, gm.router.bias)
        self.n_paths = len(cfg.domains) + 1
        self.prefix = cfg.router_context == "prefix"
        self.scar = int(cfg.scar_clusters)
        if self.scar:
            self.register_buffer("centroids", gm.scar_centroids.detach().clone())
        self.register_buffer("inv_freq", gm.rotary_emb.inv_freq.detach().clone().float(), persistent=False)

    def _mask(self, i: int, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not self.scar:
            return mask
        c: torch.Tensor = self.centroids[i]  # type: ignore[index]
        hn = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        cn = c / c.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        lab = torch.matmul(hn, cn.transpose(0, 1)).argmax(-1)  # [B, T]
        same = (lab[:, :, None] == lab[:, None, :])[:, None]
        return mask + torch.where(same, torch.zeros((), dtype=h.dtype), torch.full((), NEG, dtype=h.dtype))

    def _layer(
        self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, w: torch.Tensor | None
    ) -> torch.Tensor:
        layer: Any = self.layers[i]
        h = layer.attn_norm(x)
        q, k, v = qkv_rope(layer.attn, h, cos, sin)
        x = x + attend(layer.attn, q, k, v, self._mask(i, h, mask))
        h = layer.ffn_norm(x)
        if w is None:
            return x + layer.mlp(h)
        out = w[..., 0:1] * layer.mlp(h)
        for p, ffn in enumerate(layer.pathways):
            out = out + w[..., p + 1 : p + 2] * ffn(h)
        return x + out

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = position_ids.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        h = x
        for i in range(self.encoder_layers):
            h = self._layer(i, h, cos, sin, mask, None)
        e = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.prefix:
            e = e.cumsum(1) / (position_ids.to(e.dtype)[..., None] + 1)  # causal running mean (positions 0..T-1)
        probs = torch.softmax(self.router(e), dim=-1)
        maxp, arg = probs.max(-1)
        routes = torch.where(maxp > self.tau, arg + 1, torch.zeros_like(arg))  # the GEM rule, strict >
        w = (routes[..., None] == torch.arange(self.n_paths)).to(x.dtype)  # one-hot [B, T, n + 1]
        for i in range(len(self.layers)):
            x = self._layer(i, x, cos, sin, mask, w)
        return self.lm_head(self.norm(x)), probs, routes


def _ort_session(path: Path) -> Any:
    from moetool.export.graph.common import require

    ort = require("onnxruntime", "onnx")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _probe_windows(tok: Any, model_dir: Path, lengths: tuple[int, ...]) -> list[list[int]]:
    """One window per length per domain of held-out text (so routes cover general and every pathway)."""
    from moetool.export.heldout import held_out_text

    texts: list[str] = []
    meta = json.loads((model_dir / "moetool.json").read_text()) if (model_dir / "moetool.json").is_file() else {}
    try:
        from moetool.zoo import zoo_domain_text

        texts = [zoo_domain_text(d, "valid")[:20000] for d in meta.get("domains", [])]
    except Exception:  # not a zoo domain, or no zoo cache: the mixed held-out sample still exercises the graph
        texts = []
    if not texts:
        texts = [held_out_text(model_dir)[0]]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    tok.model_max_length = 10**9  # windows are cut below
    out = []
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        for n in lengths:
            if len(ids) >= n:
                out.append(bos + ids[: n - len(bos)])
    return out


def graph_precisions(graph: GemGraph, quant: str | None) -> dict[str, str]:
    """GemGraph weight name → fp32 | int8 | int4 under a plan (``--quant`` syntax; roles: pathways are 'experts',
    the router 'router', the general FFN 'ffn'). Graph runtimes pad partial blocks, so no GGUF row fallback."""
    from moetool.export.graph.precision import graph_precision
    from moetool.quant.plan import TensorEntry, parse_quant, resolve
    from moetool.quant.roles import Role

    if quant is None:
        return {}

    def role(name: str) -> Role:
        for key, r in (
            (".pathways.", "experts"),
            ("router.", "router"),
            (".mlp.", "ffn"),
            (".attn.", "attention"),
            ("embed.", "embeddings"),
            ("lm_head.", "output"),
        ):
            if key in name or name.startswith(key):
                return r  # type: ignore[return-value]
        return "norms"

    entries = [TensorEntry(n, tuple(p.shape), n, role(n)) for n, p in graph.named_parameters()]
    try:
        plan = resolve(parse_quant(quant), entries, fit_rows=False)
        return {a.entry.hf_name: graph_precision(a.type) for a in plan.assignments}
    except ValueError as exc:
        raise MoetoolError(f"--quant {quant!r}: {exc}") from None


def trace_graph(graph: GemGraph, path: Path) -> None:
    """torch.onnx (dynamo) with a dynamic sequence length; trace metadata (module scopes) kept for quantization."""
    seq = torch.export.Dim("seq", min=2, max=4096)
    ids = torch.randint(0, 10, (1, 8))
    args = (ids, torch.arange(8)[None], causal_mask(8, 0))
    torch.onnx.export(
        graph,
        args,
        str(path),
        dynamo=True,
        optimize=True,
        verbose=False,
        input_names=["input_ids", "position_ids", "mask"],
        output_names=["logits", "router_probs", "routes"],
        dynamic_shapes=({1: seq}, {1: seq}, {2: seq, 3: seq}),
    )


def export_token_onnx(
    model_dir: Path, output: Path, *, quant: str | None = None, force: bool = False, verify: bool = True
) -> dict[str, Any]:
    """``gem.onnx`` + ``gem-manifest.json`` (+ tokenizer) into ``output`` atomically.

    ``quant`` (e.g. ``gem``: pathways int4, router and general layers int8) quantizes MatMul weights with
    onnxruntime's MatMulNBits; fp32 parity is gated (1e-4), a quantized graph's figures are reported.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moetool.methods.gem  # noqa: F401  (registers moetool_gem)
    from moetool.card import sha256_file
    from moetool.export.graph.common import require
    from moetool.export.onnx.exporter import quantize_graph

    require("onnx", "onnx")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if getattr(model.config, "model_type", None) != "moetool_gem":
        raise MoetoolError(
            f"{model_dir}: not a token-level moetool_gem checkpoint (model_type "
            f"{model.config.model_type!r}); a sequence-level bundle exports with the same command"
        )
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
        parity: Any = "not verified"
        if verify:
            parity = token_parity(model, path, _probe_windows(tok, model_dir, SEQ_LENS))
            if not counts and (parity["max_abs_logit_diff"] > PARITY_LIMIT or parity["route_mismatches_off_boundary"]):
                raise MoetoolError(f"gem ONNX parity failed: {parity}")
        tok.save_pretrained(str(tmp))
        manifest = {
            "format": "moetool-gem-artifact/1",
            "level": "token",
            "target": "onnx",
            "file": "gem.onnx",
            "domains": list(model.config.domains),
            "tau": float(model.config.tau),
            "rule": "routes = argmax+1 where max router_probs > tau (strict) else 0 (general); inside the graph",
            "inputs": {
                "input_ids": "[1, T] int64",
                "position_ids": "[1, T] int64 (0..T-1)",
                "mask": "[1, 1, T, T] float32 additive causal mask (0 / -1e9)",
            },
            "outputs": {"logits": "[1, T, V]", "router_probs": "[1, T, n_domains]", "routes": "[1, T] int64"},
            "scar_clusters": int(model.config.scar_clusters),
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
            "quant": quant or "f32",
            "quantized_nodes": counts,
            "notes": notes,
            "parity": parity,
            "timing_s": round(time.perf_counter() - t0, 2),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def export_token_tflite(
    model_dir: Path, output: Path, *, force: bool = False, verify: bool = True, capacity: int = 128
) -> dict[str, Any]:
    """``gem.tflite`` (fp32, static length ``capacity``, router and rule inside) + manifest, converted by litert-torch
    in its own venv (moetool.methods.gem.tflite_worker); parity in the LiteRT interpreter gated like ONNX."""
    import os
    import subprocess
    import tempfile

    from transformers import AutoConfig, AutoTokenizer

    import moetool.methods.gem  # noqa: F401  (registers moetool_gem)
    from moetool.card import sha256_file
    from moetool.export.tflite.exporter import REPO, litert_python

    cfg = AutoConfig.from_pretrained(str(model_dir))
    if cfg.model_type != "moetool_gem":
        raise MoetoolError(f"{model_dir}: not a token-level moetool_gem checkpoint")
    capacity = min(capacity, int(cfg.max_position_embeddings))
    py = litert_python()
    t0 = time.perf_counter()
    with atomic_dir(output, force=force) as tmp, tempfile.TemporaryDirectory() as work:
        rp = Path(work) / "request.json"
        rp.write_text(
            json.dumps({"model_dir": str(model_dir), "out_dir": str(tmp), "capacity": capacity, "verify": verify})
        )
        proc = subprocess.run(
            [py, "-m", "moetool.methods.gem.tflite_worker", str(rp)],
            capture_output=True,
            text=True,
            env=os.environ | {"PYTHONPATH": str(REPO / "src")},
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
            raise MoetoolError(f"gem TFLite conversion failed in {py}:\n{tail}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        parity = result.get("parity", "not verified")
        if isinstance(parity, dict) and (
            parity["max_abs_logit_diff"] > PARITY_LIMIT or parity["route_mismatches_off_boundary"]
        ):
            raise MoetoolError(f"gem TFLite parity failed: {parity}")
        path = tmp / "gem.tflite"
        AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(tmp))
        manifest = {
            "format": "moetool-gem-artifact/1",
            "level": "token",
            "target": "tflite",
            "file": "gem.tflite",
            "domains": list(cfg.domains),
            "tau": float(cfg.tau),
            "capacity": capacity,
            "rule": "routes = argmax+1 where max router_probs > tau (strict) else 0 (general); inside the graph",
            "inputs": {
                "args_0": f"[1, {capacity}] int32 ids, right-padded",
                "args_1": f"[1, {capacity}] int32 positions",
                "args_2": f"[1, 1, {capacity}, {capacity}] float32 additive causal mask",
            },
            "outputs": {"output_0": "logits", "output_1": "router_probs", "output_2": "routes (int32, 0 = general)"},
            "scar_clusters": int(cfg.scar_clusters),
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
            "parity": parity,
            "timing_s": round(time.perf_counter() - t0, 2),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _strip_metadata(path: Path) -> None:
    """Drop trace metadata (stack traces with local paths) and re-save: one file, or external data past 2 GB."""
    import onnx

    from moetool.export.onnx.exporter import save_model

    m = onnx.load(str(path))
    for node in m.graph.node:
        del node.metadata_props[:]
    save_model(m, path)


@torch.no_grad()
def token_parity(model: Any, path: Path, probes: list[list[int]]) -> dict[str, Any]:
    """onnxruntime vs PyTorch on each probe: max |Δlogit|, max |ΔP|, routes that differ (for an fp32 graph a route
    may only differ where max P is within 1e-5 of tau, where the runtimes round differently), top-1 agreement and
    both perplexities over the probes (what a quantized graph costs)."""
    from moetool.export.heldout import nll

    sess = _ort_session(path)
    agree = 0
    nll_ref = nll_got = 0.0
    worst_logit = worst_p = 0.0
    mism = mism_off = 0
    tokens = 0
    share = torch.zeros(len(model.config.domains) + 1)
    lens = sorted({len(p) for p in probes})
    for ids in probes:
        x = torch.tensor([ids])
        ref = model(x)
        logits, probs, routes = sess.run(
            None,
            {
                "input_ids": x.numpy(),
                "position_ids": np.arange(len(ids))[None],
                "mask": causal_mask(len(ids), 0).numpy(),
            },
        )
        worst_logit = max(worst_logit, float(np.abs(logits - ref.logits.numpy()).max()))
        worst_p = max(worst_p, float(np.abs(probs - ref.router_probs.numpy()).max()))
        diff = routes != ref.routes.numpy()
        mism += int(diff.sum())
        near = np.abs(ref.router_probs.numpy().max(-1) - float(model.config.tau)) < 1e-5
        mism_off += int((diff & ~near).sum())
        tokens += len(ids)
        agree += int((logits[0].argmax(-1) == ref.logits[0].numpy().argmax(-1)).sum())
        nll_ref += nll(ref.logits[0].numpy(), ids)[0]
        nll_got += nll(logits[0], ids)[0]
        share += torch.bincount(ref.routes.reshape(-1), minlength=len(share)).float()
    names = ["general", *model.config.domains]
    scored = tokens - len(probes)
    return {
        "runtime": "onnxruntime",
        "reference": "PyTorch moetool_gem float32",
        "seq_lens": lens,
        "windows": len(probes),
        "tokens": tokens,
        "max_abs_logit_diff": worst_logit,
        "max_abs_prob_diff": worst_p,
        "route_mismatches": mism,
        "route_mismatches_off_boundary": mism_off,
        "top1_agreement": round(agree / tokens, 6),
        "ppl_reference": round(math.exp(nll_ref / scored), 4),
        "ppl_artifact": round(math.exp(nll_got / scored), 4),
        "route_share": {n: round(float(s / tokens), 4) for n, s in zip(names, share, strict=True)},
    }


class RouterGraph(nn.Module):
    """Sequence-level router: the general model's first layers, mean pool, W_r, softmax, the rule.
    (input_ids [1, T], position_ids [1, T], mask [1, 1, T, T]) → (router_probs [1, n], route [1] int64)."""

    def __init__(self, general: Any, n_layers: int, weight: torch.Tensor, bias: torch.Tensor, tau: float) -> None:
        super().__init__()
        cfg = general.config
        self.embed = nn.Embedding.from_pretrained(general.model.embed_tokens.weight.detach().clone(), freeze=True)
        self.layers = nn.ModuleList([_Layer(layer, cfg) for layer in general.model.layers[:n_layers]])
        self.router = _linear(weight, bias)
        self.tau = tau
        self.register_buffer("inv_freq", general.model.rotary_emb.inv_freq.detach().clone().float(), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = position_ids.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        layer: Any
        for layer in self.layers:
            h = layer.attn_norm(x)
            q, k, v = qkv_rope(layer.attn, h, cos, sin)
            x = x + attend(layer.attn, q, k, v, mask)
            x = x + layer.mlp(layer.ffn_norm(x))
        e = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).mean(1)
        probs = torch.softmax(self.router(e), dim=-1)
        maxp, arg = probs.max(-1)
        return probs, torch.where(maxp > self.tau, arg + 1, torch.zeros_like(arg))


def export_sequence_bundle(
    bundle: Path,
    output: Path,
    *,
    target: str = "onnx",
    quant: str | None = None,
    force: bool = False,
    verify: bool = True,
    console: Any = None,
) -> dict[str, Any]:
    """``router.onnx`` + ``pathways/<name>/`` (one artifact each via the regular exporter for ``target``) +
    ``gem-manifest.json``, written atomically; the router graph's parity is gated (same decisions, |ΔP| ≤ 1e-5)."""
    from moetool.api import plan_export
    from moetool.export.graph.common import require
    from moetool.methods.gem.evaluate import SequenceGem

    require("onnx", "onnx")
    if quant is None and target != "gguf":
        quant = "f32"  # plan_export's default for a plain checkpoint is f16, which the graph targets do not store
    spec = json.loads((bundle / "gem.json").read_text())
    seq = SequenceGem(bundle)
    graph = RouterGraph(seq.pathways[0], spec["encoder"]["layers"], seq.router.weight, seq.router.bias, seq.tau).eval()
    t0 = time.perf_counter()
    with atomic_dir(output, force=force) as tmp:
        rpath = tmp / "router.onnx"
        dim = torch.export.Dim("seq", min=2, max=4096)
        ids = torch.randint(0, 10, (1, 8))
        torch.onnx.export(
            graph,
            (ids, torch.arange(8)[None], causal_mask(8, 0)),
            str(rpath),
            dynamo=True,
            optimize=True,
            verbose=False,
            input_names=["input_ids", "position_ids", "mask"],
            output_names=["router_probs", "route"],
            dynamic_shapes=({1: dim}, {1: dim}, {2: dim, 3: dim}),
        )
        _strip_metadata(rpath)
        router_parity: dict[str, Any] = {}
        if verify:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(bundle))
            probes = _probe_windows(tok, bundle, SEQ_LENS)
            sess = _ort_session(rpath)
            worst, agree = 0.0, 0
            for p in probes:
                x = torch.tensor([p])
                ref_p, ref_r = seq.route(x)
                got_p, got_r = sess.run(
                    None,
                    {
                        "input_ids": x.numpy(),
                        "position_ids": np.arange(len(p))[None],
                        "mask": causal_mask(len(p), 0).numpy(),
                    },
                )
                worst = max(worst, float(np.abs(got_p - ref_p.numpy()).max()))
                agree += int((got_r == ref_r.numpy()).all())
            router_parity = {
                "windows": len(probes),
                "seq_lens": sorted({len(p) for p in probes}),
                "max_abs_prob_diff": worst,
                "same_route": agree,
            }
            if worst > 1e-5 or agree != len(probes):
                raise MoetoolError(f"gem router ONNX parity failed: {router_parity}")
        pathways = {}
        for name in seq.names:
            src = bundle / spec["pathways"][name]
            if console is not None:
                console.print(f"exporting pathway {name} → {target}")
            exporter, req, plan = plan_export(
                src, tmp / "pathways" / name, target=target, quant=quant, force=True, verify=verify
            )
            m = exporter.export(req, plan, console=console)
            pathways[name] = {
                "dir": f"pathways/{name}",
                "file": f"pathways/{name}/{m['file']}",
                "target": target,
                "parity": m.get("parity"),
            }
        for f in bundle.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy2(f, tmp / f.name)
        manifest = {
            "format": "moetool-gem-artifact/1",
            "level": "sequence",
            "domains": spec["domains"],
            "tau": seq.tau,
            "rule": "route = argmax+1 if max router_probs > tau (strict) else 0 (general); computed in router.onnx",
            "router": {
                "file": "router.onnx",
                "inputs": {
                    "input_ids": "[1, T] int64",
                    "position_ids": "[1, T] int64",
                    "mask": "[1, 1, T, T] float32 additive causal mask",
                },
                "outputs": {"router_probs": "[1, n_domains]", "route": "[1] int64 (0 = general)"},
                "parity": router_parity,
            },
            "route_names": seq.names,
            "pathways": pathways,
            "tokenizer": "tokenizer.json",
            "timing_s": round(time.perf_counter() - t0, 2),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
