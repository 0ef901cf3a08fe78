"""The MLX folder written and checked with mlx-lm's own code: load, quantize per module, save; then the written folder
loaded by mlx-lm against transformers float32 (tokenizer, logits at two lengths, a cached decode, top-1 agreement and
perplexity on held-out windows).

mlx and mlx-lm come from the ``mlx`` extra (``mlx[cpu]`` on Linux, Metal on macOS); only this module imports them.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from moetool.export.base import ExportError
from moetool.export.heldout import agreement, windows
from moetool.export.mlx.names import FLOAT_TYPES, GROUP_SIZES, bits_of
from moetool.export.parity import DecodeCheck, ParityRecord, RoundingCheck, TokenizerCheck
from moetool.extras import require
from moetool.io.jsontypes import JsonObject, JsonValue

if TYPE_CHECKING:
    from mlx.nn import Module

    from moetool.io.checkpoint import Checkpoint

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
MODE = "affine"  # scale and bias per group: what mlx-community's 4- and 8-bit models use


def _mlx() -> tuple[ModuleType, ModuleType]:
    """``mlx.core`` and ``mlx_lm.utils``, or the install command of the extra that brings them."""
    mx = require("mlx.core", "mlx", why="--target mlx")
    utils = require("mlx_lm.utils", "mlx", why="--target mlx")
    return mx, utils


def versions() -> str:
    """``mlx-lm X (mlx Y, <device>)``: the runtime a manifest names."""
    from importlib.metadata import version

    mx, _ = _mlx()
    return f"mlx-lm {version('mlx-lm')} (mlx {version('mlx')}, {mx.default_device()})"


def write_folder(
    model_dir: Path, out: Path, precisions: Mapping[str, str], overrides: Mapping[str, JsonValue]
) -> tuple[JsonObject, list[str]]:
    """Write ``model_dir`` as an mlx-lm folder in ``out``: each module's weight at its precision (``N-bit``: affine
    groups of 64, else 32, where the row length allows; a float: cast), mlx-lm's ``config.json`` with its
    ``quantization`` map, ``model.safetensors`` and the tokenizer files.

    Args:
        precisions: mlx-lm module path → MLX precision (``export.mlx.names``).
        overrides: config keys mlx-lm must read beside the folder's own (the released form, ``arch.released``).

    Returns:
        (mlx-lm's config as written, notes on modules kept at a float because no group size divides their rows).
    """
    mx, utils = _mlx()
    from mlx.utils import tree_flatten

    model, config = utils.load_model(Path(model_dir), lazy=True, model_config=dict(overrides))
    notes: list[str] = []

    def predicate(path: str, module: Module) -> bool | dict[str, int | str]:
        bits = bits_of(precisions.get(path, "f32"))
        if bits is None:
            return False
        cols = int(module.weight.shape[-1])
        group = next((g for g in GROUP_SIZES if cols % g == 0), None)
        if group is None:
            notes.append(f"{path}: rows of {cols} take no group of {' or '.join(map(str, GROUP_SIZES))}; kept as is")
            return False
        return {"group_size": group, "bits": bits, "mode": MODE}

    if any(bits_of(p) for p in precisions.values()):
        with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized model with …" line; the plan says it
            # the smallest group as the default, so mlx-lm's own divisibility check lets every module reach predicate
            model, config = utils.quantize_model(
                model, config, min(GROUP_SIZES), 4, mode=MODE, quant_predicate=predicate
            )
        _top_level_default(config)
    dtypes = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
    flat = dict(tree_flatten(model.parameters()))
    casts = [
        (name, value.astype(dtypes[precisions[name.removesuffix(".weight")]]))
        for name, value in flat.items()
        if precisions.get(name.removesuffix(".weight")) in FLOAT_TYPES
    ]
    if casts:
        model.load_weights(casts, strict=False)
    utils.save_model(out, model, donate_model=True)
    utils.save_config(config, config_path=out / "config.json")
    return config, notes


def _top_level_default(config: JsonObject) -> None:
    """Set ``quantization``'s top-level group size and bits to the most common module's: every quantized module has
    its own entry (what mlx-lm's loader reads), but tools that show one figure read the top level."""
    q = config.get("quantization")
    per_module = [v for v in q.values() if isinstance(v, dict)] if isinstance(q, dict) else []
    if isinstance(q, dict) and per_module:
        common = Counter((v["group_size"], v["bits"]) for v in per_module).most_common(1)[0][0]
        q["group_size"], q["bits"] = common


def mlx_logits(model: Module, ids: list[int]) -> np.ndarray:
    """An mlx-lm model's float32 logits ``[T, V]`` for one sequence."""
    mx, _ = _mlx()
    out: np.ndarray = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    return out


def _decode(model: Module, ids: list[int], ref: np.ndarray, steps: int) -> DecodeCheck:
    """Prefill all but ``steps`` tokens, then one token at a time through mlx-lm's KV cache, against ``ref``."""
    mx, _ = _mlx()
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    n0 = len(ids) - steps
    worst = float(np.abs(np.array(model(mx.array([ids[:n0]]), cache=cache)[0].astype(mx.float32)) - ref[:n0]).max())
    for t in range(n0, len(ids)):
        step = np.array(model(mx.array([[ids[t]]]), cache=cache)[0, -1].astype(mx.float32))
        worst = max(worst, float(np.abs(step - ref[t]).max()))
    return DecodeCheck(prefill_tokens=n0, steps=steps, max_abs_logit_diff=worst)


def _source(ck: Checkpoint, path: str, names: list[str]) -> np.ndarray:
    """The float32 source of module ``path`` from the Hugging Face tensors ``names``: one tensor; a layer's experts
    stacked by expert index; or GraniteMoE's [gate; up] stack, its half for ``gate_proj``/``up_proj``."""

    def index(name: str) -> int:
        m = _EXPERT.search(name)
        return int(m[1]) if m else 0

    arrays: list[np.ndarray] = [ck.get(n).float().numpy() for n in sorted(names, key=index)]
    if len(arrays) > 1 or (_EXPERT.search(names[0]) and "switch_mlp" in path):
        stacked: np.ndarray = np.stack(arrays)
        return stacked
    src = arrays[0]
    if "switch_mlp" in path and path.endswith(("gate_proj", "up_proj")) and not path.endswith(names[0]):
        half = src.shape[1] // 2
        part: np.ndarray = src[:, :half] if path.endswith("gate_proj") else src[:, half:]
        return part
    return src


def rounding(folder: Path, model_dir: Path, paths: Mapping[str, list[str]]) -> RoundingCheck:
    """Every quantized module of the written folder is MLX's rounding of its own source tensors, read from the
    model's safetensors independently of mlx-lm's loader (experts stacked by their index): the same bytes as
    ``mx.quantize`` gives them. Catches a module quantized from the wrong tensors, two experts swapped however alike.

    Returns:
        ``modules`` quantized and ``identical`` (equal to the source rounded), and the ``differing`` modules.
    """
    from moetool.io.checkpoint import Checkpoint

    mx, utils = _mlx()
    written = mx.load(str(Path(folder) / "model.safetensors"))
    q = utils.load_config(Path(folder)).get("quantization") or {}
    ck = Checkpoint(model_dir)
    differing = []
    modules = [(p, spec) for p, spec in q.items() if isinstance(spec, dict) and f"{p}.scales" in written]
    try:
        for path, spec in modules:
            have = [written[f"{path}.{k}"] for k in ("weight", "scales", "biases")]
            x = mx.array(_source(ck, path, paths[path])).astype(have[1].dtype)
            again = mx.quantize(x, group_size=spec["group_size"], bits=spec["bits"], mode=MODE)
            if not all(a.shape == b.shape and bool(mx.array_equal(a, b)) for a, b in zip(have, again, strict=True)):
                differing.append(path)
    finally:
        ck.close()
    return RoundingCheck(modules=len(modules), identical=len(modules) - len(differing), differing=tuple(differing))


def check_folder(
    folder: Path,
    model_dir: Path,
    text: str,
    paths: Mapping[str, list[str]],
    *,
    seq_lens: tuple[int, ...] = (32, 128),
    n_windows: int = 4,
) -> ParityRecord:
    """The written folder in mlx-lm against ``model_dir`` in transformers float32, on ``text``; its quantized
    modules against the source tensors (``paths``: module → Hugging Face names, :func:`rounding`).

    Raises:
        ExportError: mlx-lm's tokenizer for the folder encodes the text differently from the model's own, or a
            quantized module is not its source rounded.
    """
    weights = rounding(folder, model_dir, paths)
    if weights.differing:
        raise ExportError(
            f"{folder}: {', '.join(weights.differing[:3])} are not MLX's rounding of their source tensors in "
            f"{model_dir} ({len(weights.differing)} of {weights.modules} quantized modules)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, utils = _mlx()
    model, _ = utils.load_model(Path(folder))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    theirs = utils.load_tokenizer(Path(folder))
    samples = [text[i : i + 500] for i in range(0, min(len(text), 4000), 500)]
    for sample in samples:
        if list(theirs.encode(sample)) != list(tok(sample)["input_ids"]):
            raise ExportError(f"{folder}: mlx-lm's tokenizer encodes {sample[:40]!r}… differently from {model_dir}'s")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    max_pos = int(getattr(hf.config, "max_position_embeddings", 2048))
    lens = sorted({min(n, max_pos) for n in seq_lens})
    probes, ppl_windows = windows(tok, text, lens, n_windows)
    got = [mlx_logits(model, ids) for ids in probes + ppl_windows]
    vs = agreement(got, hf, probes, ppl_windows)
    with torch.no_grad():
        ref = hf(torch.tensor([probes[-1]])).logits[0].numpy()
    record = ParityRecord(
        runtime=versions(),
        reference="transformers float32",
        tokenizer=TokenizerCheck(match=True, probes=len(samples)),
        weights=weights,
        seq_lens=tuple(lens),
        decode=_decode(model, probes[-1], ref, 8),
        tokens_scored=sum(len(w) - 1 for w in ppl_windows),
    )
    return record.with_figures(vs)
