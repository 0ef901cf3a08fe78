"""Summarise a checkpoint: architecture, experts, routers, total and active parameters, size on disk.

A Hugging Face folder or an mlx-lm one (``moetool export --target mlx``): its packed weights are counted unpacked and
its stacked experts (``switch_mlp``) as experts, so both give the figures of the model the folder holds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from moetool.arch.outputs import expert_count, shared_expert_width
from moetool.io.checkpoint import Checkpoint
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.io.mlx_folder import mlx_layout, parameter_shapes
from moetool.io.safe import read_json

_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.")
# a layer's experts as one tensor per projection: transformers' fused layout, GraniteMoE's, mlx-lm's switch_mlp
_STACKED_EXPERTS = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp\.experts\.(?:gate_up_proj|down_proj)"
    r"|block_sparse_moe\.(?:input_linear|output_linear)\.weight"
    r"|(?:block_sparse_moe|mlp)\.switch_mlp\.(?:gate|up|down)_proj\.weight)$"
)
_ROUTER = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$")


def inspect_model(path: str | Path) -> JsonObject:
    """Facts about the checkpoint at ``path`` (dense or MoE; per-expert, fused or mlx-lm layout).

    Raises:
        SourceError: an mlx-lm folder whose ``config.json`` does not give the bits of a packed module.
    """
    ck = Checkpoint(Path(path))
    cfg = ck.config
    meta_file = Path(path) / "moetool.json"
    meta = read_json(meta_file, what="moetool metadata") if meta_file.is_file() else {}
    n_exp = expert_count(cfg)
    top_k = cfg.get("num_experts_per_tok") or 0
    total = 0
    expert_params = 0
    routers: dict[int, JsonValue] = {}
    for name, shape in parameter_shapes(cfg, ck.tensors).items():
        total += math.prod(shape)
        if _EXPERT.match(name) or _STACKED_EXPERTS.match(name):
            expert_params += math.prod(shape)
        m = _ROUTER.match(name)
        if m:
            routers[int(m.group(1))] = [*shape]
    tied = bool(cfg.get("tie_word_embeddings")) and "lm_head.weight" not in ck.tensors
    # routed experts outside the top-k are idle for a token; everything else is always active
    active = total - (expert_params * (n_exp - top_k) // n_exp if n_exp else 0)
    files = [p for p in Path(path).iterdir() if p.is_file()]
    names = meta.get("experts") if isinstance(meta, dict) else None
    mlx = mlx_layout(cfg, ck.tensors)
    return {
        "path": str(Path(path).resolve()),
        "layout": f"mlx-lm: {mlx}" if mlx else "Hugging Face",
        "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
        "model_type": cfg.get("model_type"),
        "layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "num_experts": n_exp,
        "experts_per_token": top_k,
        "expert_names": names or [f"expert_{i}" for i in range(n_exp)],
        "shared_expert": bool(shared_expert_width(cfg)),  # the null one moetool writes is none
        "router_shapes": {str(k): v for k, v in sorted(routers.items())},
        "total_params": total,
        "active_params_per_token": active,
        "tied_embeddings": tied,
        "size_on_disk_bytes": sum(p.stat().st_size for p in files),
        "method": meta.get("method") if isinstance(meta, dict) else None,
    }
