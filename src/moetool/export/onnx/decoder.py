"""The ONNX decoder in the convention ONNX LLM runners (onnxruntime-genai, optimum) drive: one graph for prefill
and decode, an int64 ``attention_mask`` over past and new tokens (left padding for batches), explicit
``position_ids``, ``past_key_values.{i}.key|value`` in and ``present.{i}.key|value`` out, an empty past for the
prefill, plus the ``genai_config.json`` and tokenizer files onnxruntime-genai reads from the folder.

Shapes: ``input_ids`` [batch_size, sequence_length] int64; ``attention_mask`` [batch_size, total_sequence_length]
int64 (1 = attend, 0 = padding); ``position_ids`` [batch_size, sequence_length] int64; past
[batch_size, kv_heads, past_sequence_length, head_dim]; ``logits`` [batch_size, sequence_length, vocab]; present
[batch_size, kv_heads, total_sequence_length, head_dim], where total = past + sequence.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from moetool.arch.records import require_record
from moetool.export.graph.model import NEG, ExportLM
from moetool.export.jsonnum import integer
from moetool.io.jsontypes import JsonObject, JsonValue

if TYPE_CHECKING:
    from onnx import ModelProto

# files a runner reads beside the graph: the tokenizer (onnxruntime-extensions reads tokenizer.json and its config),
# the chat template, and the configs optimum and people look for
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)
SCOPE = "em."  # OnnxDecoder's ExportLM attribute: the traced module names' prefix before the plan's names


def past_names(n_layers: int, prefix: str = "past_key_values") -> list[str]:
    """``{prefix}.0.key, {prefix}.0.value, {prefix}.1.key, …`` in ExportLM's past order."""
    return [f"{prefix}.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


class OnnxDecoder(nn.Module):
    """ExportLM behind the runner convention: the additive mask is built inside the graph from
    ``attention_mask`` (causal over the new tokens, padding masked) instead of being an input."""

    def __init__(self, em: ExportLM) -> None:
        super().__init__()
        self.em = em

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        t, s = input_ids.shape[1], attention_mask.shape[1]
        query_at = torch.arange(t, device=input_ids.device) + (s - t)  # [T]: each new token's index among the keys
        keys = torch.arange(s, device=input_ids.device)  # [S]
        keep = (keys[None, :] <= query_at[:, None])[None] & (attention_mask[:, None, :] > 0)  # [B, T, S]
        mask = torch.where(keep, 0.0, NEG)[:, None]  # [B, 1, T, S]; NEG is finite: a padded row stays finite
        out: tuple[torch.Tensor, ...] = self.em(input_ids, position_ids, mask, *past)
        return out


def name_dims(model: ModelProto) -> None:
    """Rename the exporter's symbols (``s10``, …) after the roles the inputs give them, everywhere they occur."""
    roles = {"input_ids": ("batch_size", "sequence_length"), "attention_mask": ("batch_size", "total_sequence_length")}
    graph = model.graph
    rename: dict[str, str] = {}
    for inp in graph.input:
        dims = inp.type.tensor_type.shape.dim
        if inp.name in roles:
            pairs = list(zip((0, 1), roles[inp.name], strict=True))
        elif inp.name.startswith("past_key_values."):
            pairs = [(0, "batch_size"), (2, "past_sequence_length")]
        else:
            continue
        for axis, role in pairs:
            if dims[axis].dim_param:
                rename.setdefault(dims[axis].dim_param, role)
    for info in [*graph.input, *graph.output, *graph.value_info]:
        for d in info.type.tensor_type.shape.dim:
            if d.dim_param in rename:
                d.dim_param = rename[d.dim_param]


def _token_ids(value: JsonValue) -> list[int]:
    if value is None:
        return []
    return [
        integer(v, "eos_token_id", "generation_config.json") for v in (value if isinstance(value, list) else [value])
    ]


def genai_config(model_dir: Path, em: ExportLM, filename: str, context: int) -> JsonObject:
    """``genai_config.json`` for the decoder: its I/O names, shapes of the cache, the special ids from the model's
    generation config (else its config), greedy search by default."""
    cfg = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = _token_ids(gen.get("eos_token_id", cfg.get("eos_token_id")))
    pad = gen.get("pad_token_id", cfg.get("pad_token_id"))
    # onnxruntime-genai checks `type` (the record's); the graph I/O is what it runs
    rec = require_record(cfg["model_type"], "onnxruntime-genai model type")
    attn = em.blocks()[0].attn
    return {
        "model": {
            "bos_token_id": gen.get("bos_token_id", cfg.get("bos_token_id")),
            "eos_token_id": [*eos],
            "pad_token_id": eos[0] if pad is None and eos else pad,
            "context_length": context,
            "type": rec.genai_type,
            "vocab_size": int(cfg["vocab_size"]),
            "decoder": {
                "session_options": {"log_id": "moetool", "provider_options": []},
                "filename": filename,
                "head_size": attn.head_dim,
                "hidden_size": int(cfg["hidden_size"]),
                "num_attention_heads": attn.n_head,
                "num_key_value_heads": attn.n_kv,
                "num_hidden_layers": em.n_layers,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "max_length": context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,  # the graph concatenates: present is past + new, not a fixed buffer
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "early_stopping": True,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
        },
    }


def write_runner_files(model_dir: Path, out_dir: Path, em: ExportLM, filename: str, context: int) -> list[str]:
    """Write ``genai_config.json`` and copy the tokenizer and config files the model has; returns the names."""
    (out_dir / "genai_config.json").write_text(json.dumps(genai_config(model_dir, em, filename, context), indent=2))
    copied = ["genai_config.json"]
    for name in SIDE_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)
            copied.append(name)
    return copied
