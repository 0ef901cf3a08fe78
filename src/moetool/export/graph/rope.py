"""Rope for the graph export model: cos/sin from explicit position ids, scaled as transformers scales them.

Frequencies and the attention factor come from transformers' own ``ROPE_INIT_FUNCTIONS`` (the reference), once,
at build time, so a traced graph holds constants:

- ``linear``, ``yarn``, ``llama3``: one fixed set of inverse frequencies; yarn's attention factor multiplies cos
  and sin (so q and k), as in transformers.
- ``longrope``: both sets are kept and the graph picks one per call, exactly as transformers does: the long
  factors when ``max(position_ids) + 1`` exceeds ``original_max_position_embeddings``, the short ones otherwise
  (a max over the whole batch, as transformers takes it, a compare and a where, which every converter handles).
  With a KV cache the keys already cached keep the factors they were computed with, as in transformers. A
  static-cache graph (TFLite, Core ML) prefills a padded window, so there the switch sees the padded length.
- ``dynamic`` is refused: transformers recomputes its frequencies from the running length past
  max_position_embeddings and keeps them across calls, state a traced graph does not have.

Shapes: ``position_ids`` [B, T] int64 → cos, sin [B, 1, T, head_dim].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PretrainedConfig

import torch
from torch import nn

SUPPORTED_ROPE = ("default", "linear", "yarn", "llama3", "longrope")


def rope_type(cfg: PretrainedConfig) -> str:
    params = getattr(cfg, "rope_parameters", None) or {}
    return str(params.get("rope_type", "default"))


class HFRotary(Protocol):
    """A transformers rotary embedding: its (current) inverse frequencies; ``original_inv_freq`` and
    ``attention_scaling`` are read where present."""

    inv_freq: torch.Tensor


class GraphRope(nn.Module):
    """cos/sin for explicit positions; built from a loaded transformers model's config and rotary embedding."""

    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor

    def __init__(self, cfg: PretrainedConfig, rotary: HFRotary) -> None:
        super().__init__()
        kind = rope_type(cfg)
        if kind not in SUPPORTED_ROPE:
            why = (
                "dynamic NTK recomputes the frequencies from the running sequence length past "
                "max_position_embeddings and keeps them across calls, which a traced graph cannot; use "
                "'yarn' or 'linear' scaling"
                if kind == "dynamic"
                else f"graph export supports {', '.join(SUPPORTED_ROPE)}"
            )
            raise ValueError(f"config.json: rope_type {kind!r} is not supported by the export model: {why}")
        # original_inv_freq: transformers' longrope switches rotary.inv_freq in place on every forward
        short = getattr(rotary, "original_inv_freq", rotary.inv_freq)
        self.register_buffer("inv_freq", short.detach().clone().float(), persistent=False)
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.switch: int | None = None
        if kind == "longrope":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            self.switch = int(cfg.rope_parameters["original_max_position_embeddings"])
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, short.device, seq_len=self.switch + 1)
            self.register_buffer("long_inv_freq", long.detach().clone().float(), persistent=False)

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.switch is not None:
            longer = (position_ids.max() + 1) > self.switch
            inv_freq = torch.where(longer, self.long_inv_freq, self.inv_freq)
        freqs = position_ids.float()[..., None] * inv_freq  # [B, T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, hd]
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)
