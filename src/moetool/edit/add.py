"""``moetool experts add``: a dense expert of the MoE's base (or a LoRA adapter of it, baked) becomes one more expert in
every MoE layer, with its router row from prompts through the router's real input.

The row is computed as the merge computes one (``gate_mode: hidden``): the mean router input over the prompts' content
tokens, minus the mean over the negative prompts, L2-normalised; here the input is the edited MoE's own (every layer
sees the mixture below it, as at run time), and the row is scaled to the mean norm of the layer's existing rows so it
competes on their scale (a tuned router's rows grow beyond unit norm).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from moetool.arch.families import FAMILIES, MLP_PROJS, dense_mlp_name
from moetool.edit.layout import EditError, MoELayout, require_tokenizer
from moetool.edit.plan import EditPlan, Slot, select_plan
from moetool.io.checkpoint import SAFETENSORS_DTYPES, Checkpoint, read_safetensors_header
from moetool.io.files import tokenizer_signature
from moetool.io.safe import read_json
from moetool.io.writer import ShardedWriter

# config keys an added expert must share with the MoE (its foundation)
FOUNDATION = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def check_request(name: str, prompts: list[str]) -> None:
    """A usable expert name and at least one prompt, before anything is read.

    Raises:
        EditError: naming the option.
    """
    if not prompts:
        raise EditError("--prompt: give at least one prompt for the new expert's router row")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise EditError(f"--name {name!r}: letters, digits, '_', '.', '-' only, starting with a letter or digit")


def _tokenizer(path: Path) -> Any:
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _attention_differs(layout: MoELayout, ck: Checkpoint) -> list[str]:
    """A warning when the source's first attention weight differs from the MoE's (not a plain expert of its base)."""
    q = "model.layers.0.self_attn.q_proj.weight"
    if q not in ck.tensors or q not in layout.tensors:
        return []
    moe = Checkpoint(layout.path)
    try:
        dtype = SAFETENSORS_DTYPES[layout.tensors[q].dtype][0]
        if torch.equal(ck.get(q).to(dtype), moe.get(q)):
            return []
    finally:
        moe.close()
    return [
        f"--source: its attention differs from the MoE's ({q}); an expert is its MLP alone, so only that is taken "
        "(as the merge does)"
    ]


def check_source(layout: MoELayout, source: Path, name: str) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """The dense MLP shapes an added expert brings, after checking it fits the MoE; and warnings.

    Raises:
        EditError: a name already taken, a source that is not a dense model of the MoE's foundation, MLPs of another
            width, or another tokenizer (every problem, one per line).
    """
    problems, warnings = [], []
    if name in layout.names:
        problems.append(f"--name: the MoE already has an expert {name!r}")
    ck = Checkpoint(source)
    try:
        cfg = ck.config
        tensors = ck.tensors
        if cfg.get("model_type") not in FAMILIES:
            problems.append(
                f"--source: {source} is a {cfg.get('model_type')!r} model, not a dense model of a supported family "
                f"({', '.join(FAMILIES)})"
            )
        for key in FOUNDATION:
            if cfg.get(key) != layout.config.get(key):
                problems.append(f"--source: {key} is {cfg.get(key)!r}, the MoE has {layout.config.get(key)!r}")
        width = layout.width()
        shapes: dict[str, tuple[int, ...]] = {}
        for layer in layout.moe_layers:
            for p in MLP_PROJS:
                info = tensors.get(dense_mlp_name(layer, p))
                if info is None:
                    problems.append(f"--source: missing tensor {dense_mlp_name(layer, p)}")
                    continue
                want = (width, cfg.get("hidden_size")) if p != "down_proj" else (cfg.get("hidden_size"), width)
                if info.shape != want:
                    problems.append(
                        f"--source: {info.name} has shape {list(info.shape)}; the MoE's experts {list(want)}"
                    )
                shapes[info.name] = info.shape
            if len(problems) > 8:
                break
        if not problems:
            warnings += _attention_differs(layout, ck)
    finally:
        ck.close()
    sig, own = tokenizer_signature(_tokenizer(source)), tokenizer_signature(_tokenizer(layout.path))
    if sig is None:
        warnings.append(f"--source: {source} has no tokenizer; vocabulary match not checked")
    elif own is not None and sig != own:
        problems.append("--source: its tokenizer differs from the MoE's (vocabulary or special tokens)")
    if problems:
        raise EditError("\n".join(problems))
    return shapes, warnings


def _adapter_config(adapter: Path) -> tuple[dict[str, Any], float]:
    """A plain LoRA adapter's config and its scale ``s`` (alpha/r, or alpha/√r with rsLoRA).

    Raises:
        EditError: not a LoRA adapter, DoRA, per-module rank or alpha patterns, or a rank or alpha that is not a
            positive number.
    """
    cfg = read_json(adapter / "adapter_config.json", what="PEFT adapter config", error=EditError)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise EditError(f"--source: {adapter} is a {cfg.get('peft_type')!r} adapter; only LoRA adapters bake")
    if cfg.get("use_dora"):
        raise EditError(f"--source: {adapter} is a DoRA adapter; only plain LoRA bakes exactly")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise EditError(f"--source: {adapter} has per-module rank or alpha patterns, which moetool does not bake")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise EditError(f"--source: {adapter}/adapter_config.json: r is {r!r}, not a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise EditError(f"--source: {adapter}/adapter_config.json: lora_alpha is {alpha!r}, not a finite number")
    return cfg, alpha / r**0.5 if cfg.get("use_rslora") else alpha / r


def _adapter_files(adapter: Path) -> list[Path]:
    files = sorted(adapter.glob("adapter_model*.safetensors"))
    if not files:
        raise EditError(f"--source: {adapter} has no adapter_model.safetensors (pickle adapters are not read)")
    return files


def _adapted_module(adapter: Path, key: str) -> tuple[str, str]:
    """``(base weight name, "A" | "B")`` of one adapter tensor, refusing one that adapts more than an MLP."""
    target, _, kind = key.rpartition(".lora_")
    module = target.removeprefix("base_model.model.")
    if not any(module.endswith(f".mlp.{p}") for p in MLP_PROJS):
        raise EditError(
            f"--source: {adapter} adapts {module}; an expert is an MLP (attention is shared by every expert), "
            "so only adapters of gate_proj, up_proj and down_proj can be added"
        )
    return module + ".weight", kind.split(".")[0]


def check_adapter(adapter: Path, base: Path, layout: MoELayout) -> None:
    """Refuse, from configs and headers before anything is written, a LoRA adapter that cannot be baked into
    ``base`` or whose base is not of the MoE's foundation.

    Raises:
        EditError: what :func:`_adapter_config` refuses; an adapted module that is not an MLP; a base of another
            foundation than the MoE (naming both widths); an update whose shape is not its base weight's (naming
            the adapter's width and the base's).
    """
    _adapter_config(adapter)
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for f in _adapter_files(adapter):
        for key, info in read_safetensors_header(f).items():
            name, kind = _adapted_module(adapter, key)
            shapes.setdefault(name, {})[kind] = info.shape
    base_ck = Checkpoint(base)
    try:
        cfg, weights = base_ck.config, base_ck.tensors
    finally:
        base_ck.close()
    problems = [
        f"--base {base}: {key} is {cfg.get(key)!r}, the MoE has {layout.config.get(key)!r} (the adapter's base must "
        "be the MoE's base)"
        for key in FOUNDATION
        if cfg.get(key) != layout.config.get(key)
    ]
    wrong = []
    for name, ab in sorted(shapes.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            problems.append(f"--source: {adapter}: {name} has no matching lora_A [r, in] and lora_B [out, r] pair")
            continue
        held = weights.get(name)
        if held is None:
            problems.append(f"--source: {adapter} adapts {name}, which {base} does not have")
        elif (b[0], a[1]) != held.shape:
            wrong.append((name, (b[0], a[1]), held.shape))
    if wrong:  # one line for them all: an adapter of another model is wrong in every weight it adapts
        name, got, want = wrong[0]
        problems.append(
            f"--source: {adapter} was trained on a model of another width: it updates {name} as {list(got)} (hidden "
            f"size {_widths(name, got)}) where {base} holds {list(want)} (hidden size {_widths(name, want)}); "
            f"{len(wrong)} of its {len(shapes)} adapted weights so"
        )
    if problems:
        raise EditError("\n".join(problems))


def _widths(name: str, shape: tuple[int, ...]) -> str:
    """The hidden size and MLP width an MLP weight's shape holds (gate/up: ``[width, hidden]``; down: the reverse)."""
    hidden, width = (shape[0], shape[1]) if name.endswith("down_proj.weight") else (shape[1], shape[0])
    return f"{hidden}, MLP width {width}"


def bake_adapter(adapter: Path, base: Path, out: Path) -> Path:
    """A LoRA adapter of ``base`` baked into ``base``'s MLPs: ``W + s·B·A`` per adapted projection (``s`` = alpha/r,
    or alpha/√r with rsLoRA), written to ``out`` as a whole dense model with ``base``'s config and tokenizer.

    Raises:
        EditError: not a LoRA adapter, one that adapts more than the MLPs (attention is shared by every expert), DoRA,
            or per-module rank or alpha patterns.
    """
    _cfg, scale = _adapter_config(adapter)
    files = _adapter_files(adapter)
    from safetensors.torch import load_file

    lora: dict[str, torch.Tensor] = {}
    for f in files:
        lora |= load_file(str(f))
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in lora.items():
        name, kind = _adapted_module(adapter, key)
        deltas.setdefault(name, {})[kind] = t
    base_ck = Checkpoint(base)
    try:
        # the whole model, MLPs baked: a dense expert like any other (the parity check runs it as one)
        entries = [(n, SAFETENSORS_DTYPES[i.dtype][0], i.shape) for n, i in base_ck.tensors.items()]
        out.mkdir(parents=True, exist_ok=True)
        with ShardedWriter(out, entries, 2**62) as writer:
            for n, dtype, _ in entries:
                w = base_ck.get(n)
                if n in deltas:
                    d = deltas[n]
                    w = (w.double() + scale * (d["B"].double() @ d["A"].double())).to(dtype)
                writer.add(n, w)
        config = dict(base_ck.config)
    finally:
        base_ck.close()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    from moetool.io.files import copy_tokenizer

    copy_tokenizer(base, out)
    return out


def adapter_base(adapter: Path, given: Path | None) -> Path:
    """The dense model a LoRA adapter was trained on: ``given`` (``--base``), else its ``base_model_name_or_path``.

    Raises:
        EditError: neither names a local model folder.
    """
    if given is not None:
        return given
    cfg = read_json(adapter / "adapter_config.json", what="PEFT adapter config", error=EditError)
    named = cfg.get("base_model_name_or_path")
    if isinstance(named, str) and named and (Path(named) / "config.json").is_file():
        return Path(named)
    raise EditError(
        f"--source: {adapter} is a LoRA adapter of {named!r}, which is not a local model folder; give it with --base"
    )


@torch.inference_mode()
def router_rows(
    layout: MoELayout,
    prompts: list[str],
    negative: list[str],
    *,
    chat_template: bool = False,
    dtype: str | None = None,
    device: str | None = None,
) -> dict[str, torch.Tensor]:
    """The added expert's router row ``[H]`` of each MoE layer (key ``router.{layer}``), from the MoE's own router
    inputs over the prompts.

    Raises:
        EditError: a prompt with no content tokens.
    """
    from moetool.eval.perplexity import load_causal_lm
    from moetool.routing.init import mlp_input_means, normalise_rows

    require_tokenizer(layout.path, "the new expert's router row (its prompts)")
    model, tok = load_causal_lm(layout.path, dtype=dtype or "auto", device=device or "auto")
    try:
        v = mlp_input_means(model, tok, prompts, chat_template=chat_template)
        if negative:
            v = v - mlp_input_means(model, tok, negative, chat_template=chat_template)
    except ValueError as exc:
        raise EditError(f"--prompt: {exc}") from None
    rows = normalise_rows(v)  # [L, H]
    ck = Checkpoint(layout.path)
    try:
        out = {}
        for layer in layout.moe_layers:
            existing = ck.get(layout.router(layer)).float()
            out[f"router.{layer}"] = rows[layer] * existing.norm(dim=-1).mean()
        return out
    finally:
        ck.close()


def add_plan(
    layout: MoELayout, source: Path, name: str, shapes: dict[str, tuple[int, ...]], record: dict[str, Any]
) -> EditPlan:
    """The MoE with the dense ``source``'s MLP as a new last expert ``name`` in every MoE layer."""
    keep: dict[int, list[Slot]] = {layer: [*range(layout.n_experts), "new"] for layer in layout.moe_layers}
    plan = select_plan(
        layout,
        keep,
        kind="add",
        names=[*layout.names, name],
        top_k=layout.top_k,
        record=record,
        new=shapes,
    )
    plan.sources["new"] = source
    return plan
