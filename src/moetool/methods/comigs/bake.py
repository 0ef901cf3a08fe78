"""Bake one user's CoMiGS model into a standard Mixtral checkpoint, or write its experts as PEFT adapters.

Expert j's LoRA is merged into its own copy of the base MLP (``W + γ B A`` per linear), the shared attention LoRA
into the attention weights, and the router becomes Mixtral's gate. CoMiGS routes with softmax over the top-k logits,
which equals Mixtral's softmax → top-k → renormalise, so the result is the same function: checked on real tokens
against the checkpoint reloaded from disk by transformers (max |Δlogit| ≤ 1e-5 with both evaluated in float64; the
float32 figure is reported too) before the output is moved into place. Every
exporter then applies unchanged (``moetool export OUT/<user> ...``). An ``average``-routed model (Local/FedAvg
baselines) gets a zero gate: equal weights over all experts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from moetool.arch.outputs import MIXTRAL
from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir
from moetool.io.files import copy_tokenizer
from moetool.methods.comigs.model import ComigsForCausalLM, LoRAExpert, LoRALinear, register

if TYPE_CHECKING:
    from transformers import MixtralForCausalLM

PARITY_TOL = 1e-5
FLOAT32_TOL = 1e-3  # float32 evaluation of merged vs unmerged weights: summation order only


class BakeReport(TypedDict):
    """``comigs-bake.json``: the Mixtral written and its logits against the CoMiGS model's on the probe (float64, the
    gate, and float32)."""

    architecture: str
    experts: list[str]
    n_generalists: int
    top_k: int
    parity_max_abs_logit_diff: float
    parity_max_abs_logit_diff_float32: float
    parity_tokens: int
    parity_tol: float


def merged_expert(model: ComigsForCausalLM, layer: int, j: int) -> dict[str, torch.Tensor]:
    """Dense ``{gate_proj, up_proj, down_proj}`` weights of expert j in ``layer`` (LoRA merged)."""
    moe = model.moe_layers[layer]
    e = moe.experts[j]
    assert isinstance(e, LoRAExpert)
    out = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        # merged in float64 and rounded once, so the stored weight is the nearest float32 to W + γBA
        w = getattr(moe.base, proj).weight.detach().double()
        if proj in moe.targets:
            w = w + moe.scaling * getattr(e, f"{proj}_B").detach().double() @ getattr(e, f"{proj}_A").detach().double()
        out[proj] = w.float()
    return out


def to_mixtral(model: ComigsForCausalLM) -> MixtralForCausalLM:
    """An in-memory ``MixtralForCausalLM`` computing the same function as ``model``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = model.config
    dense = cfg.dense_config()
    verdict = MIXTRAL.supports(dense, shared=False)
    if not verdict.ok:
        raise MoetoolError(
            f"bake: a Mixtral output needs a {' or '.join(MIXTRAL.accepts)} base without attention biases "
            f"(mixtral {verdict.reason}); use `moetool comigs adapters` for GGUF LoRA adapters instead"
        )
    n, k = cfg.n_experts, cfg.experts_per_token
    mix_cfg = MixtralConfig.from_dict(MIXTRAL.make_config(dense, n_experts=n, top_k=k, shared_intermediate=None))
    mix = MixtralForCausalLM(mix_cfg)
    mix.float().eval()  # in place
    src = model.lm
    with torch.no_grad():
        mix.model.embed_tokens.weight.copy_(src.model.embed_tokens.weight)
        mix.model.norm.weight.copy_(src.model.norm.weight)
        if not mix_cfg.tie_word_embeddings:
            mix.lm_head.weight.copy_(src.lm_head.weight)
        for li, (s_layer, m_layer) in enumerate(zip(src.model.layers, mix.model.layers, strict=True)):
            m_layer.input_layernorm.weight.copy_(s_layer.input_layernorm.weight)
            m_layer.post_attention_layernorm.weight.copy_(s_layer.post_attention_layernorm.weight)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                lin = getattr(s_layer.self_attn, proj)
                w = lin.merged_weight() if isinstance(lin, LoRALinear) else lin.weight
                getattr(m_layer.self_attn, proj).weight.copy_(w)
            moe = model.moe_layers[li]
            gate = m_layer.mlp.gate.weight
            gate.copy_(moe.router.weight if moe.router is not None else torch.zeros_like(gate))
            for j in range(n):
                w = merged_expert(model, li, j)
                m_layer.mlp.experts.gate_up_proj[j].copy_(torch.cat([w["gate_proj"], w["up_proj"]], dim=0))
                m_layer.mlp.experts.down_proj[j].copy_(w["down_proj"])
    return mix


@torch.inference_mode()
def max_logit_diff(a: torch.nn.Module, b: torch.nn.Module, ids: torch.Tensor) -> float:
    """max |logits_a - logits_b| over ``ids [B, T]``."""
    a.eval()
    b.eval()
    return float((a(input_ids=ids).logits.float() - b(input_ids=ids).logits.float()).abs().max())


def bake(
    model: ComigsForCausalLM,
    output: Path,
    *,
    ids: torch.Tensor,
    tokenizer_dir: Path | None = None,
    force: bool = False,
    tol: float = PARITY_TOL,
) -> BakeReport:
    """Write ``model`` as a Mixtral checkpoint to ``output`` (atomically) after checking parity on ``ids [B, T]``
    against the checkpoint reloaded from disk. Returns the parity report (also written as comigs-bake.json).

    Raises:
        MoetoolError: parity above ``tol`` (nothing is written), or an unsupported base.
    """
    from transformers import AutoModelForCausalLM

    mix = to_mixtral(model)
    with atomic_dir(Path(output), force=force) as tmp:
        mix.save_pretrained(str(tmp))
        if tokenizer_dir is not None:
            copy_tokenizer(Path(tokenizer_dir), tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
        diff32 = max_logit_diff(model, reloaded, ids)
        # The gate: both evaluated in float64, so what is compared is the function the checkpoint stores, not float32
        # summation order (merged W+γBA vs W x + γ B(A x) differ by ~1e-5 in float32 on logits of size ~10-30).
        # float32 -> float64 -> float32 is exact, so the model is unchanged afterwards.
        # (the eager expert loop: transformers' default grouped-mm kernel has no float64)
        reloaded64 = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float64, experts_implementation="eager")
        dtype = next(model.parameters()).dtype
        try:
            diff = max_logit_diff(model.double(), reloaded64, ids)
        finally:
            torch.nn.Module.to(model, dtype=dtype)
        report = BakeReport(
            architecture="MixtralForCausalLM",
            experts=list(model.config.expert_names),
            n_generalists=model.config.n_generalists,
            top_k=model.config.experts_per_token,
            parity_max_abs_logit_diff=diff,
            parity_max_abs_logit_diff_float32=diff32,
            parity_tokens=int(ids.numel()),
            parity_tol=tol,
        )
        if not diff <= tol or not diff32 <= FLOAT32_TOL:
            raise MoetoolError(
                f"bake: Mixtral logits differ from the CoMiGS model by {diff:.3g} in float64 (limit {tol:g}) and "
                f"{diff32:.3g} in float32 (limit {FLOAT32_TOL:g})"
            )
        (tmp / "comigs-bake.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def save_adapters(model: ComigsForCausalLM, output: Path, *, base_model: str, force: bool = False) -> list[Path]:
    """One PEFT LoRA adapter per expert (its MLP LoRA + the shared attention LoRA), rsLoRA scaling kept exact.

    Each adapter over the dense base is that expert alone (a dense model); ``moetool export`` converts PEFT adapters
    to GGUF LoRA adapters for llama.cpp. Returns the adapter directories.
    """
    from safetensors.torch import save_file

    cfg = model.config
    out_dirs = []
    with atomic_dir(Path(output), force=force) as tmp:
        for j, name in enumerate(cfg.expert_names):
            tensors: dict[str, torch.Tensor] = {}
            for li, moe in enumerate(model.moe_layers):
                e = moe.experts[j]
                for proj in moe.targets:
                    key = f"base_model.model.model.layers.{li}.mlp.{proj}"
                    tensors[f"{key}.lora_A.weight"] = getattr(e, f"{proj}_A").detach().float().contiguous()
                    tensors[f"{key}.lora_B.weight"] = getattr(e, f"{proj}_B").detach().float().contiguous()
                if cfg.attn_rank:
                    attn = model.lm.model.layers[li].self_attn
                    for proj in cfg.attn_targets:
                        lin = getattr(attn, proj)
                        # PEFT's α/√r (rank_pattern when the attention rank differs) equals CoMiGS's: no folding
                        key = f"base_model.model.model.layers.{li}.self_attn.{proj}"
                        tensors[f"{key}.lora_A.weight"] = lin.lora_A.detach().float().contiguous()
                        tensors[f"{key}.lora_B.weight"] = lin.lora_B.detach().float().contiguous()
            d = tmp / name
            d.mkdir()
            ranks = {t.shape[0] for k, t in tensors.items() if k.endswith("lora_A.weight")}
            adapter_cfg = {
                "peft_type": "LORA",
                "base_model_name_or_path": base_model,
                "r": cfg.lora_rank,
                "lora_alpha": cfg.lora_alpha,
                "use_rslora": True,
                "target_modules": sorted({*cfg.mlp_targets, *(cfg.attn_targets if cfg.attn_rank else [])}),
                "rank_pattern": {p: cfg.attn_rank for p in cfg.attn_targets} if len(ranks) > 1 else {},
                "alpha_pattern": {},
                "lora_dropout": 0.0,
                "bias": "none",
                "task_type": "CAUSAL_LM",
                "fan_in_fan_out": False,
                "inference_mode": True,
            }
            (d / "adapter_config.json").write_text(json.dumps(adapter_cfg, indent=2) + "\n", encoding="utf-8")
            save_file(tensors, str(d / "adapter_model.safetensors"))
            out_dirs.append(Path(output) / name)
    return out_dirs


def load_user(model: Path) -> ComigsForCausalLM:
    """A user's trained model (``moetool comigs train`` output), float32, in eval mode.

    Raises:
        MoetoolError: no config.json, or a model of another type.
    """
    from transformers import AutoModelForCausalLM

    register()
    if not (model / "config.json").is_file():
        raise MoetoolError(f"{model}: no config.json (expected a user model written by `moetool comigs train`)")
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    if not isinstance(m, ComigsForCausalLM):
        raise MoetoolError(f"{model}: model_type is {m.config.model_type!r}, not moetool_comigs")
    result: ComigsForCausalLM = m.eval()
    return result


# the parity probe of a bake: code, licence and plain English, so every expert's tokens occur
BAKE_PROBE = "The quick brown fox jumps over the lazy dog. def main(): return 0. Permission is hereby granted."


def bake_user(model_dir: Path, output: Path, *, force: bool = False) -> BakeReport:
    """Bake a user's model directory into a Mixtral checkpoint, parity-checked on :data:`BAKE_PROBE`."""
    from transformers import AutoTokenizer

    m = load_user(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = torch.tensor([tok(BAKE_PROBE, add_special_tokens=True)["input_ids"][:64]])
    return bake(m, output, ids=ids, tokenizer_dir=model_dir, force=force)
