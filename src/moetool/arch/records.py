"""Every model record by ``model_type``, and the GGUF tensor map derived from the records' name templates.

Adding an output architecture is one ``MoEArch`` in ``arch/outputs.py`` (plus its parity test): the recipe's allowed
``architecture:`` values, the GGUF names of its router and experts, its llama.cpp architecture, its top-k rule, its
onnxruntime-genai type and the graph targets that take it are all read from that record.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from moetool.arch.consumers import differing, ignoring_rope_scaling, rope_scaling_type
from moetool.arch.facts import GraphTarget, ModelFacts, config_int
from moetool.arch.families import FAMILIES, MLP_PROJS
from moetool.arch.outputs import OUTPUT_ARCHS, MoEArch, expert_count, shared_expert_width
from moetool.errors import UnsupportedArchitecture

MODEL_RECORDS: dict[str, ModelFacts] = {
    **FAMILIES,
    **{a.model_type: a for a in OUTPUT_ARCHS.values()},
}


def model_record(model_type: object) -> ModelFacts | None:
    """The record of ``model_type`` (a config's ``model_type``), or None for one moetool does not know."""
    return MODEL_RECORDS.get(str(model_type))


def require_record(model_type: object, what: str) -> ModelFacts:
    """The record of ``model_type``.

    Raises:
        UnsupportedArchitecture: moetool has no record of it, naming ``what`` needed one and the known types.
    """
    rec = model_record(model_type)
    if rec is None:
        raise UnsupportedArchitecture(f"model_type {model_type!r} has no {what}; supported: {', '.join(MODEL_RECORDS)}")
    return rec


def graph_model_types(target: GraphTarget | None = None) -> tuple[str, ...]:
    """Model types the graph export model computes (for ``target``, or for any graph target)."""
    return tuple(
        mt for mt, r in MODEL_RECORDS.items() if (target in r.graph_targets if target else bool(r.graph_targets))
    )


# (HF regex, GGUF template) for the tensors every family names the same way (llama-style); {i} is the layer
COMMON_GGUF_TENSORS: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(?P<i>\d+)\.input_layernorm\.weight", "blk.{i}.attn_norm.weight"),
    (r"model\.layers\.(?P<i>\d+)\.post_attention_layernorm\.weight", "blk.{i}.ffn_norm.weight"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.q_proj\.(?P<k>weight|bias)", "blk.{i}.attn_q.{k}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.k_proj\.(?P<k>weight|bias)", "blk.{i}.attn_k.{k}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.v_proj\.(?P<k>weight|bias)", "blk.{i}.attn_v.{k}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.o_proj\.(?P<k>weight|bias)", "blk.{i}.attn_output.{k}"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.q_norm\.weight", "blk.{i}.attn_q_norm.weight"),
    (r"model\.layers\.(?P<i>\d+)\.self_attn\.k_norm\.weight", "blk.{i}.attn_k_norm.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.gate_proj\.weight", "blk.{i}.ffn_gate.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.up_proj\.weight", "blk.{i}.ffn_up.weight"),
    (r"model\.layers\.(?P<i>\d+)\.mlp\.down_proj\.weight", "blk.{i}.ffn_down.weight"),
)
_GGUF_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _regex(template: str, proj: str = "") -> str:
    """A record's name template as a regex: ``{layer}`` → group ``i``, ``{expert}`` → group ``e``."""
    marked = template.format(layer="LAYERMARK", expert="EXPERTMARK", proj=proj)
    return re.escape(marked).replace("LAYERMARK", r"(?P<i>\d+)").replace("EXPERTMARK", r"(?P<e>\d+)")


def moe_gguf_tensors(arch: MoEArch) -> tuple[list[tuple[str, str]], list[tuple[str, tuple[str, ...]]]]:
    """llama.cpp's names for ``arch``'s router, experts and shared expert, from the record's templates.

    Returns (rules, split rules): ``rules`` are (HF regex, GGUF template) pairs, per-expert tensors carrying their
    index in group ``e`` (stacked into one [E, ...] tensor per layer); ``split rules`` are a stacked tensor whose
    rows (dim -2) are the GGUF tensors in equal parts, in order (GraniteMoE's [gate; up] of every expert).
    """
    rules = [(_regex(arch.router), "blk.{i}.ffn_gate_inp.weight")]
    splits: list[tuple[str, tuple[str, ...]]] = []
    if arch.expert:
        rules += [
            (_regex(arch.expert, arch.proj_map[p]), f"blk.{{i}}.ffn_{_GGUF_PROJ[p]}_exps.weight") for p in MLP_PROJS
        ]
    for template, projs in arch.stacked:
        names = tuple(f"blk.{{i}}.ffn_{_GGUF_PROJ[p]}_exps.weight" for p in projs)
        if len(names) == 1:
            rules.append((_regex(template), names[0]))
        else:
            splits.append((_regex(template), names))
    if arch.shared:
        rules += [(_regex(arch.shared, p), f"blk.{{i}}.ffn_{_GGUF_PROJ[p]}_shexp.weight") for p in MLP_PROJS]
    if arch.shared_gate:
        rules.append((_regex(arch.shared_gate), "blk.{i}.ffn_gate_inp_shexp.weight"))
    return rules, splits


def _gguf_maps() -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, tuple[str, ...]], ...]]:
    rules: dict[str, str] = dict(COMMON_GGUF_TENSORS)
    splits: dict[str, tuple[str, ...]] = {}
    for arch in OUTPUT_ARCHS.values():
        r, s = moe_gguf_tensors(arch)
        rules |= dict(r)
        splits |= dict(s)
    return tuple(rules.items()), tuple(splits.items())


# every HF tensor name moetool maps to GGUF: (HF regex, GGUF template), and the split stacked tensors
GGUF_TENSOR_MAP, GGUF_SPLIT_MAP = _gguf_maps()


def topk_rule(cfg: Mapping[str, object]) -> tuple[ModelFacts, bool] | None:
    """``cfg``'s model record and whether the model renormalises its top-k routing weights, where that matters.

    ``cfg`` is config.json as a dict. None for a model type moetool does not know, a dense model, or one choosing all
    its experts (renormalising changes nothing there).
    """
    rec = model_record(cfg.get("model_type"))
    n, k = expert_count(cfg), config_int(cfg, "num_experts_per_tok")
    if rec is None or not n or k >= n:
        return None
    return rec, rec.normalises_topk(cfg)


def converter_caveat(cfg: Mapping[str, object]) -> str | None:
    """Why a consumer other than transformers would compute another function from a model of config ``cfg``.

    ``cfg`` is config.json as a dict. None when every consumer moetool knows (llama.cpp's ``convert_hf_to_gguf.py``,
    mlx-lm, vLLM: ``arch.consumers``) weights the top-k experts as transformers does. The converter writes every
    model type as its own llama.cpp architecture (``ModelFacts.gguf_arch``), whose top-k rule may differ from the
    model's; the others have a class per model type with its own rule.
    """
    chosen = topk_rule(cfg)
    if chosen is None or chosen[0].gguf.renormalises_topk is None:
        return None
    rec, norm = chosen
    others = differing(cfg, norm)
    said = f"this model has norm_topk_prob: {str(norm).lower()}"
    parts = []
    if norm != rec.gguf.renormalises_topk:
        rule = "always" if rec.gguf.renormalises_topk else "never"
        ways = []
        unshared = rec.gguf_unshared
        if not shared_expert_width(cfg) and unshared is not None and unshared.renormalises_topk == norm:
            ways.append(f"`moetool export --target gguf` (exact: it writes llama.cpp's {unshared.name!r} form)")
        if rec.topk == "config":
            ways.append(f"a merge with `norm_topk_prob: {str(not norm).lower()}`")
        parts.append(
            f"llama.cpp's convert_hf_to_gguf.py writes this {rec.model_type} as its {rec.gguf.name!r} architecture, "
            f"which {rule} renormalises the top-k routing weights, but {said}: a GGUF from that converter computes a "
            f"different function. Use {' or '.join(ways) or 'ONNX'} instead"
        )
    if others:
        names = " and ".join(f"{c.name} ({c.checked})" for c in others)
        fix = (
            f"; a merge with `norm_topk_prob: {str(not norm).lower()}` computes alike everywhere"
            if rec.topk == "config"
            else ""
        )
        parts.append(
            f"{names} {'do not renormalise' if norm else 'renormalise'} this {rec.model_type}'s top-k routing weights "
            f"where transformers {'does' if norm else 'does not'} ({said}): loaded there it computes a different "
            f"function{fix}"
        )
    return ". ".join(parts) or None


def rope_caveat(cfg: Mapping[str, object]) -> str | None:
    """Why a consumer would load a model of config dict ``cfg`` with another rope (None when every one scales it).

    mlx-lm's Mixtral and Qwen MoE classes ignore ``rope_scaling``.
    """
    ignoring = ignoring_rope_scaling(cfg)
    if not ignoring:
        return None
    names = " and ".join(f"{c.name} ({c.checked})" for c in ignoring)
    return (
        f"{names} load{'s' if len(ignoring) == 1 else ''} a {cfg.get('model_type')} with the plain rope, ignoring this "
        f"model's {rope_scaling_type(cfg)} rope_scaling: loaded there it computes a different function at every "
        f"position. transformers, vLLM and llama.cpp scale it"
    )


def consumer_caveats(cfg: Mapping[str, object]) -> list[str]:
    """Every reason a consumer other than transformers computes another function from a model of config ``cfg``."""
    return [c for c in (converter_caveat(cfg), rope_caveat(cfg)) if c]
