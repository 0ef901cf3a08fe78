"""Export a hybrid model: the router as its own tiny ONNX graph (onnxruntime parity), each expert through the
existing exporters, a manifest, and a small reference dispatcher.

The router graph is self-contained when the router reads the cheap encoder's token embeddings (encoder_layers 0)
and routes per sequence: ``input_ids [1, T]`` (+ ``domain [1, D]`` one-hot) → ``scores [1, K]``, ``choice [1]``;
the embedding table, standardisation and MLP are inside. Otherwise it takes the feature vectors
``features [N, F]`` → ``scores [N, K]``, ``choice [N]`` and the caller builds features (router.py).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import numpy as np
import torch
from rich.console import Console
from torch import nn

from moetool.errors import MoetoolError
from moetool.export.base import ExportError, check_artifact_dir
from moetool.export.bundle import Bundle, Member, MemberArtifact, export_bundle
from moetool.export.graph.common import onnx_export
from moetool.export.parity import ParityRecord, RouteCheck
from moetool.extras import require
from moetool.io.files import copy_tokenizer
from moetool.io.jsontypes import JsonObject
from moetool.io.safe import read_json
from moetool.methods.hybrid.assemble import read_model
from moetool.methods.hybrid.data import pooled_hidden
from moetool.methods.hybrid.records import ExpertRow, FeatureLayoutDoc, ModelMeta
from moetool.methods.hybrid.router import FeatureLayout, HybridRouter, sequence_features

ROUTER_ONNX = "router.onnx"
DISPATCHER = "dispatch.py"


class RouterGraph(nn.Module):
    """Token ids (+ domain one-hot) → scores and hard choice, features computed inside (router.py's definitions)."""

    def __init__(self, router: HybridRouter, layout: FeatureLayoutDoc, embedding: torch.Tensor | None) -> None:
        super().__init__()
        self.router = router
        self.use_length = bool(layout["length"])
        self.n_domains = int(layout["n_domains"])
        self.max_length = float(layout["max_length"])
        self.embedding: nn.Embedding | None = nn.Embedding.from_pretrained(embedding) if embedding is not None else None

    def forward(self, input_ids: torch.Tensor, domain: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        if self.use_length:
            # token count as data (ones summed), not as a shape, so the graph keeps T dynamic
            n = torch.ones_like(input_ids, dtype=torch.float32).sum(dim=1, keepdim=True)
            parts.append(torch.clamp(n, max=self.max_length) / self.max_length)
        if self.n_domains and domain is not None:
            parts.append(domain)
        if self.embedding is not None:
            parts.append(self.embedding(input_ids).mean(dim=1))
        scores = self.router.scores(torch.cat(parts, dim=-1))
        return scores, scores.argmax(dim=-1)


class FeatureRouterGraph(nn.Module):
    """``features [N, F]`` → scores ``[N, K]`` and choice ``[N]``."""

    def __init__(self, router: HybridRouter) -> None:
        super().__init__()
        self.router = router

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.router.scores(features)
        return scores, scores.argmax(dim=-1)


def self_contained(meta: ModelMeta) -> bool:
    rc = meta["router"]
    return rc["granularity"] == "sequence" and rc["encoder_layers"] == 0 and rc["decision"] == "argmax"


def encoder_embedding(meta: ModelMeta) -> torch.Tensor | None:
    """The encoder expert's token embedding table ``[V, H]`` (read from its safetensors), or None."""
    rc = meta["router"]
    if not rc["layout"]["hidden_dim"]:
        return None
    from transformers import AutoModelForCausalLM

    path = next(e["path"] for e in meta["experts"] if e["name"] == rc["encoder"])
    embedding = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).get_input_embeddings()
    if not isinstance(embedding, nn.Embedding):
        raise MoetoolError(f"expert {rc['encoder']!r} ({path}): its input embedding is not an nn.Embedding")
    return embedding.weight.detach().clone()


class RouterGraphDoc(TypedDict):
    """The router graph's entry in the manifest, as traced: its inputs and outputs, and whether it is
    self-contained (token ids in) or takes the feature vectors."""

    inputs: list[str]
    outputs: list[str]
    self_contained: bool


class ExportedExpert(TypedDict):
    """An expert row of a hybrid export's manifest: where its artifact is (``dir``/``file``), or why the target
    refused it (``exported: false``, ``reason``)."""

    name: str
    dir: NotRequired[str]
    file: NotRequired[str]


class HybridExport(TypedDict):
    """What :func:`load_export` reads back from a hybrid export's ``manifest.json``."""

    format: str
    name: str
    experts: list[ExportedExpert]


def export_router_onnx(meta: ModelMeta, router: HybridRouter, path: Path) -> RouterGraphDoc:
    """Trace the router graph with torch.onnx (dynamo) to ``path``; returns its input/output description."""

    if self_contained(meta):
        graph: nn.Module = RouterGraph(router, meta["router"]["layout"], encoder_embedding(meta)).eval()
        nd = meta["router"]["layout"]["n_domains"]
        ids = torch.randint(0, 10, (1, 8))
        seq = torch.export.Dim("seq", min=1, max=1 << 16)
        shapes: tuple[dict[int, torch.export.Dim] | None, ...]
        if nd:
            args: tuple[torch.Tensor, ...] = (ids, torch.zeros(1, nd))
            names, shapes = ["input_ids", "domain"], ({1: seq}, None)
        else:
            args, names, shapes = (ids,), ["input_ids"], ({1: seq},)
    else:
        graph = FeatureRouterGraph(router).eval()
        n = torch.export.Dim("n", min=1, max=1 << 20)
        args, names, shapes = (torch.zeros(2, router.in_features),), ["features"], ({0: n},)
    onnx_export(graph, args, path, inputs=names, outputs=["scores", "choice"], dynamic_shapes=shapes)
    return RouterGraphDoc(inputs=names, outputs=["scores", "choice"], self_contained=self_contained(meta))


def router_parity(
    meta: ModelMeta, router: HybridRouter, path: Path, requests: list[tuple[list[int], int]]
) -> ParityRecord:
    """onnxruntime vs PyTorch on ``requests`` (token ids incl. BOS, domain id): features built the way training built
    them (router.py / data.py), so this checks the whole graph, not just the MLP."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    lay = meta["router"]["layout"]
    layout = FeatureLayout(lay["length"], lay["n_domains"], lay["hidden_dim"], lay["max_length"])
    emb = encoder_embedding(meta) if layout.hidden_dim else None
    worst, agree = 0.0, 0
    for ids, dom in requests:
        t_ids = torch.tensor([ids])
        pooled = pooled_hidden(emb[t_ids], torch.tensor([len(ids)])) if emb is not None else None
        feats = sequence_features(layout, torch.tensor([len(ids)]), torch.tensor([dom]), pooled)
        with torch.no_grad():
            ref = router.scores(feats)
        if self_contained(meta):
            feed: dict[str, np.ndarray] = {"input_ids": np.array([ids], dtype=np.int64)}
            if layout.n_domains:
                onehot = np.zeros((1, layout.n_domains), dtype=np.float32)
                if dom >= 0:
                    onehot[0, dom] = 1.0
                feed["domain"] = onehot
        else:
            feed = {"features": feats.numpy().astype(np.float32)}
        scores, choice = sess.run(["scores", "choice"], feed)
        worst = max(worst, float(np.abs(scores - ref.numpy()).max()))
        agree += int(int(choice[0]) == int(ref.argmax(-1)[0]))
    return ParityRecord(
        runtime=f"onnxruntime {ort.__version__}",
        reference="PyTorch router on features built as in training",
        requests=len(requests),
        routes=RouteCheck(max_abs_score_diff=worst, choice_agreement=agree / max(1, len(requests))),
    )


def _parity_requests(meta: ModelMeta, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Held-out-like requests for the parity check: zoo/recipe text is not needed, the expert's tokenizer on
    varied lengths of random ids is enough to exercise every feature (lengths past max_length included)."""
    g = torch.Generator().manual_seed(seed)
    vocab = int(meta["tokenizer"]["vocab_size"])
    bos = meta["tokenizer"]["special_ids"]["bos_token_id"] or 0
    max_len = int(meta["router"]["layout"]["max_length"])
    nd = int(meta["router"]["layout"]["n_domains"])
    out = []
    for i in range(n):
        length = int(torch.randint(2, int(max_len * 1.25) + 1, (), generator=g))
        ids = [bos, *torch.randint(0, vocab, (length - 1,), generator=g).tolist()]
        out.append((ids, (i % (nd + 1)) - 1 if nd else -1))
    return out


def export_hybrid(
    model_dir: Path,
    output: Path,
    *,
    expert_target: str = "gguf",
    quant: str | None = None,
    force: bool = False,
    verify: bool = True,
    experts: bool = True,
    parity_requests: int = 64,
    console: Console | None = None,
) -> JsonObject:
    """Write ``output``: router.onnx, experts/<name>/ (each via moetool's exporters), tokenizer, dispatch.py and
    manifest.json. An expert the chosen exporter cannot handle is recorded with the reason, not silently skipped.

    Raises:
        MissingExtraError: the onnx extra is missing (checked before anything is read or written).
        MoetoolError: the router graph fails parity (max |Δscore| > 1e-4 or any choice differs).
    """

    check_artifact_dir(output)
    # the router is always an ONNX graph checked in onnxruntime, whatever the experts' target; onnxscript is what
    # torch.onnx's dynamo exporter traces with
    for module in ("onnx", "onnxscript", "onnxruntime"):
        require(module, "onnx", why="the hybrid router's ONNX export (router.onnx)")
    meta, router = read_model(model_dir)

    def write_router(tmp: Path) -> dict[str, Any]:  # export_bundle's router callback
        graph = export_router_onnx(meta, router, tmp / ROUTER_ONNX)
        parity = router_parity(meta, router, tmp / ROUTER_ONNX, _parity_requests(meta, parity_requests))
        if not _router_passes(parity):
            raise MoetoolError(f"router ONNX parity failed: {parity.to_json()}")
        parity = replace(parity, verdict="pass")
        tok_dir = tmp / "tokenizer"
        tok_dir.mkdir()
        copy_tokenizer(Path(meta["experts"][0]["path"]), tok_dir)
        shutil.copy2(Path(__file__).with_name("dispatch_template.py"), tmp / DISPATCHER)
        shutil.copy2(Path(model_dir) / "latency_profile.json", tmp / "latency_profile.json")
        # the dynamo exporter keeps large initialisers (the embedding table) in router.onnx.data beside the graph
        files = sorted(f.name for f in tmp.glob(f"{ROUTER_ONNX}*"))
        return {
            **graph,
            "file": ROUTER_ONNX,
            "files": files,
            "config": meta["router"],
            # the training tokenizer's special ids: dispatch.py starts every request with this BOS, as training
            "special_ids": meta["tokenizer"]["special_ids"],
            "parity": parity.to_json(),
            "bytes": sum((tmp / f).stat().st_size for f in files),
        }

    def write_manifest(tmp: Path, entry: dict[str, Any], artifacts: list[MemberArtifact]) -> dict[str, Any]:
        exported = {a.name: a.to_json() for a in artifacts}
        rows = [
            {"name": e["name"], "model_type": e["model_type"], "kind": e["kind"]} | exported.get(e["name"], {})
            for e in meta["experts"]
        ]
        # the files, hashes, source weights and parity (router and each expert) are added by export_bundle
        return {
            "format": "moetool-hybrid-export",
            "version": 1,
            "name": meta["name"],
            "router": entry,
            "experts": rows,
            "costly": meta["costly"],
            "dispatcher": DISPATCHER,
            "tokenizer": "tokenizer/",
            "latency_profile": "latency_profile.json",
        }

    members = [_member(e, expert_target, quant, verify) for e in meta["experts"]] if experts else []
    # an expert the chosen target cannot take is recorded with the reason: the other experts still ship
    bundle = Bundle(members, expert_target, quant, verify, tolerate=True)
    return export_bundle(
        Path(output), bundle, source=Path(model_dir), router=write_router, manifest=write_manifest, force=force,
        console=console,
    )  # fmt: skip


def _router_passes(parity: ParityRecord) -> bool:
    """The router graph's gate: every score within 1e-4 of PyTorch's and every choice the same."""
    routes = parity.routes
    return (
        routes is not None
        and routes.max_abs_score_diff is not None
        and routes.max_abs_score_diff <= 1e-4
        and routes.choice_agreement == 1.0
    )


def _member(e: ExpertRow, target: str, quant: str | None, verify: bool) -> Member:
    """One expert of the bundle; a Mamba expert's GGUF is written by the Mamba GGUF writer."""
    writer = None
    if e["model_type"] == "mamba" and target == "gguf":
        from moetool.export.gguf.mamba import export_mamba_gguf

        def writer(source: Path, out: Path) -> dict[str, Any]:
            return export_mamba_gguf(source, out, quant=quant or "f32", verify=verify) | {"target": "gguf"}

    return Member(e["name"], Path(e["path"]), f"experts/{e['name']}", writer)


def load_export(path: Path) -> HybridExport:
    """The manifest of a hybrid model's ``moetool export`` folder.

    Raises:
        ExportError: no such folder, no manifest.json, or a manifest that is not a hybrid export's, naming the file
            and the command that writes one.
    """
    manifest = Path(path) / "manifest.json"
    writes_it = "`moetool export MODEL -o DIR` of a hybrid model writes it"
    if not Path(path).is_dir():
        raise ExportError(f"{path}: no such directory; a hybrid export folder is expected ({writes_it})")
    if not manifest.is_file():
        raise ExportError(f"{manifest}: missing; {path} is not a hybrid export folder ({writes_it})")
    data = read_json(manifest, what="hybrid export manifest", error=ExportError)
    experts = data.get("experts")
    if data.get("format") != "moetool-hybrid-export" or not isinstance(experts, list):
        raise ExportError(f"{manifest}: format is {data.get('format')!r}, not a hybrid export manifest ({writes_it})")
    rows: list[ExportedExpert] = []
    for i, e in enumerate(experts):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise ExportError(f"{manifest}: experts.{i}: not an expert entry with a name")
        row = ExportedExpert(name=str(e["name"]))
        if isinstance(folder := e.get("dir"), str):
            row["dir"] = folder
        if isinstance(file := e.get("file"), str):
            row["file"] = file
        rows.append(row)
    name = data.get("name")
    return HybridExport(format="moetool-hybrid-export", name=name if isinstance(name, str) else "", experts=rows)
