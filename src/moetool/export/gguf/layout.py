"""Which GGUF tensors a checkpoint becomes, under which llama.cpp architecture (no weights are read)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from moetool.arch.facts import LlamaCppArch, ModelFacts
from moetool.arch.outputs import expert_count, shared_expert_width
from moetool.arch.records import require_record
from moetool.errors import UnsupportedArchitecture
from moetool.export.base import ExportError
from moetool.export.gguf.names import gguf_name, split_names
from moetool.export.gguf.rope import ROPE_TENSORS, plan_rope
from moetool.export.jsonnum import integer
from moetool.io.jsontypes import JsonValue
from moetool.quant.plan import TensorEntry

# a zero-width Qwen2-MoE shared expert is written this wide (all zeros: it adds exactly nothing)
SHEXP_PAD = 32


@dataclass
class GGUFTensor:
    name: str
    sources: list[str]  # HF tensors, in expert order when stacked
    shape: tuple[int, ...]  # torch order, after stacking
    permute_heads: int | None = None  # Q/K rows to reorder for NORM rope
    squeeze: bool = False  # [1, H] → [H]
    zeros: bool = False  # padding with no source
    rows: tuple[int, int] | None = None  # this slice of the source's rows (dim -2), for a split stacked tensor

    def entry(self) -> TensorEntry:
        hf = self.sources[0] if self.sources else self.name
        if len(self.sources) > 1:
            hf = re.sub(r"\.experts\.\d+\.", ".experts.*.", hf)
        role = "shared_expert" if self.zeros and "shexp" in self.name else None
        if self.name in ROPE_TENSORS:  # llama.cpp's own rope factors: no HF name to read a role from
            role = "attention"
        return TensorEntry(hf_name=hf, shape=self.shape, out_name=self.name, role=role)  # type: ignore[arg-type]


@dataclass
class Layout:
    arch: str  # llama.cpp's architecture name (``llama_cpp.name``)
    model_type: str
    tensors: list[GGUFTensor]
    llama_cpp: LlamaCppArch
    n_experts: int = 0
    top_k: int = 0
    expert_ff: int | None = None
    shared_ff: int | None = None
    notes: list[str] = field(default_factory=list)


def _moe_facts(cfg: Mapping[str, JsonValue], rec: ModelFacts) -> tuple[int, int, bool]:
    n = expert_count(cfg)
    k = integer(cfg.get("num_experts_per_tok") or 0, "num_experts_per_tok")
    return n, k, rec.normalises_topk(cfg)


def _record(cfg: Mapping[str, JsonValue]) -> ModelFacts:
    try:
        return require_record(cfg.get("model_type"), "GGUF mapping")
    except UnsupportedArchitecture as exc:  # an export error like the other refusals of the layout
        raise ExportError(str(exc)) from None


def plan_layout(cfg: Mapping[str, JsonValue], tensor_shapes: dict[str, tuple[int, ...]]) -> Layout:
    """Map every HF tensor to its GGUF tensor and pick the llama.cpp architecture.

    Raises:
        ExportError: unsupported model types, rope scaling, activations, or MoE routing llama.cpp computes
            differently (naming the reason and what would work).
    """
    mt = str(cfg.get("model_type"))
    rec = _record(cfg)
    ll, notes = _choose_arch(cfg, rec)
    n, k, _ = _moe_facts(cfg, rec)
    out = _map_tensors(cfg, tensor_shapes, ll.permute_qk, n)
    rope = plan_rope(cfg, ll.name)  # scaled rope's keys and factor tensors; refuses what llama.cpp cannot compute
    out |= {nm: GGUFTensor(nm, [], arr.shape) for nm, arr in rope.tensors.items()}
    notes += rope.notes
    width = cfg.get("shared_expert_intermediate_size") if rec.has_shared_expert else None
    shared_ff = None if width is None else integer(width, "shared_expert_intermediate_size")
    if ll.shared_expert and not shared_ff:
        shared_ff = _pad_shared_expert(out, cfg)
        notes.append(f"zero-width shared expert written as {SHEXP_PAD} zero columns (llama.cpp requires one)")
    elif ll.shared_expert and not shared_expert_width(cfg):
        notes.append(
            f"moetool's null shared expert ({shared_ff} zero column) written as it is: it adds exactly nothing"
        )
    elif not ll.shared_expert and rec.has_shared_expert:  # the unshared form: the null shared expert is left out
        for nm in [x for x in out if "shexp" in x]:
            del out[nm]
    if "output.weight" not in out and ll.shared_expert:  # the one arch whose loader requires output.weight
        emb = out["token_embd.weight"]
        out["output.weight"] = GGUFTensor("output.weight", list(emb.sources), emb.shape)
    return Layout(
        arch=ll.name,
        model_type=mt,
        tensors=[out[nm] for nm in sorted(out, key=_tensor_order)],
        llama_cpp=ll,
        n_experts=n,
        top_k=k,
        expert_ff=integer(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0, "intermediate_size")
        if n
        else None,
        shared_ff=shared_ff,
        notes=notes,
    )


def _choose_arch(cfg: Mapping[str, JsonValue], rec: ModelFacts) -> tuple[LlamaCppArch, list[str]]:
    """(llama.cpp architecture, notes), refusing what llama.cpp would compute differently from transformers."""
    ll = rec.gguf
    if cfg.get("hidden_act", "silu") != "silu":
        raise ExportError(f"hidden_act {cfg.get('hidden_act')!r}: llama.cpp's {ll.name} uses SiLU")
    n, k, norm = _moe_facts(cfg, rec)
    notes: list[str] = []
    if not n:
        return ll, notes
    shared_ff = shared_expert_width(cfg)  # 0 for the null shared expert moetool writes in place of none
    unshared = rec.gguf_unshared
    if not shared_ff and unshared is not None and (k == n or norm == unshared.renormalises_topk):
        notes.append(
            f"{rec.model_type} without a shared expert and with norm_topk_prob: {str(norm).lower()} is written as "
            f"llama.cpp's {unshared.name!r} MoE (the Mixtral form), which computes the same function"
        )
        return unshared, notes
    if k < n and norm != ll.renormalises_topk:
        rule = "always" if ll.renormalises_topk else "never"
        way_out = (
            f"Merge with `norm_topk_prob: {str(not norm).lower()}` in the recipe for a llama.cpp-compatible "
            f"{rec.model_type}, or export to ONNX"
            if rec.topk == "config"
            else "export to ONNX"
        )
        raise ExportError(
            f"this {rec.model_type} {'has a shared expert and ' if shared_ff else ''}norm_topk_prob: "
            f"{str(norm).lower()}, but llama.cpp's {ll.name} {rule} renormalises the top-k softmax weights, so a "
            f"GGUF would compute a different function. {way_out}"
        )
    return ll, notes


def _map_tensors(
    cfg: Mapping[str, JsonValue], tensor_shapes: dict[str, tuple[int, ...]], permute: bool, n: int
) -> dict[str, GGUFTensor]:
    """GGUF name → tensor for every HF tensor; per-expert tensors are stacked into one [n, ...] tensor."""
    n_head = integer(cfg["num_attention_heads"], "num_attention_heads")
    n_kv = integer(cfg.get("num_key_value_heads") or n_head, "num_key_value_heads")
    out: dict[str, GGUFTensor] = {}
    experts: dict[str, dict[int, str]] = {}
    skipped: list[str] = []
    for hf, shape in tensor_shapes.items():
        if parts := split_names(hf):
            out |= _split(hf, tuple(shape), parts)
            continue
        mapped = gguf_name(hf)
        if mapped is None:
            if not hf.endswith("rotary_emb.inv_freq"):  # recomputed by every runtime
                skipped.append(hf)
            continue
        name, expert = mapped
        if expert is not None:
            experts.setdefault(name, {})[expert] = hf
            continue
        t = GGUFTensor(name, [hf], tuple(shape))
        if permute and (".attn_q." in name or ".attn_k." in name):
            t.permute_heads = n_head if ".attn_q." in name else n_kv
        if name.endswith("ffn_gate_inp_shexp.weight"):
            t.squeeze, t.shape = True, (shape[-1],)
        out[name] = t
    if skipped:
        raise ExportError(f"tensors with no GGUF place: {', '.join(skipped[:5])}{' …' if len(skipped) > 5 else ''}")
    for name, by_e in experts.items():
        if sorted(by_e) != list(range(n)):
            raise ExportError(f"{name}: experts {sorted(by_e)} present, config says {n}")
        first = tensor_shapes[by_e[0]]
        out[name] = GGUFTensor(name, [by_e[e] for e in range(n)], (n, *first))
    return out


def _split(hf: str, shape: tuple[int, ...], parts: tuple[str, ...]) -> dict[str, GGUFTensor]:
    """The GGUF tensors that take equal slices of ``hf``'s rows (dim -2), e.g. GraniteMoE's [gate; up] of every
    expert → ffn_gate_exps and ffn_up_exps."""
    rows, rem = divmod(shape[-2], len(parts))
    if rem:
        raise ExportError(f"{hf}: {shape[-2]} rows do not split into {len(parts)} equal parts")
    out = {}
    for j, name in enumerate(parts):
        out[name] = GGUFTensor(name, [hf], (*shape[:-2], rows, shape[-1]), rows=(j * rows, (j + 1) * rows))
    return out


def _pad_shared_expert(out: dict[str, GGUFTensor], cfg: Mapping[str, JsonValue]) -> int:
    """Add an all-zero shared expert to every layer of ``out``; returns its width.

    llama.cpp's qwen2moe requires a shared expert; zeros add nothing (its sigmoid gate then multiplies 0).
    """
    hidden = integer(cfg["hidden_size"], "hidden_size")
    for layer in range(integer(cfg["num_hidden_layers"], "num_hidden_layers")):
        for proj, shape in (
            ("gate", (SHEXP_PAD, hidden)),
            ("up", (SHEXP_PAD, hidden)),
            ("down", (hidden, SHEXP_PAD)),
        ):
            nm = f"blk.{layer}.ffn_{proj}_shexp.weight"
            out[nm] = GGUFTensor(nm, [], shape, zeros=True)
        nm = f"blk.{layer}.ffn_gate_inp_shexp.weight"
        out[nm] = GGUFTensor(nm, [], (hidden,), zeros=True)
    return SHEXP_PAD


def _tensor_order(nm: str) -> tuple[int, str]:
    """Sort key: globals, then per layer (llama.cpp reads tensors by name; the order only keeps files readable)."""
    m = re.match(r"blk\.(\d+)\.", nm)
    return (int(m.group(1)) + 1 if m else (0 if nm.startswith("token") else 10**9), nm)
