"""PEFT LoRA adapters → GGUF adapters: llama.cpp with ``lora_path`` equals the base with the LoRA merged in."""

from __future__ import annotations

import json

import llama_cpp  # noqa: F401  (the dev extra installs it; a missing runtime must fail, not skip)
import pytest
import torch
from safetensors.torch import save_file

from moetool.api import export
from moetool.export import ExportError
from moetool.export.gguf.lora import merged_checkpoint


def _peft_adapter(
    base, out, *, rslora=False, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(str(out))
    return peft_model


@pytest.mark.parametrize("rslora", [False, True])
def test_dense_adapter_matches_merged(tiny_models, tmp_path, rslora):
    base = tiny_models("llama")["base"]
    peft_model = _peft_adapter(base, tmp_path / "ad", rslora=rslora)
    # our reference (W + s·B·A) is what peft itself merges
    ref = merged_checkpoint(base, tmp_path / "ad", tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32)
    theirs = peft_model.merge_and_unload()
    ids = torch.randint(4, 300, (1, 12))
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max() < 1e-5

    man = export(tmp_path / "ad", tmp_path / "gg", base=base)
    assert man["target"] == "gguf-lora" and man["scaling_folded_into_b"] == rslora
    p = man["parity"]
    assert p["tokenizer_match"] and max(p["max_abs_logit_diff"].values()) <= 1e-3


def test_expert_adapter_is_stacked(tiny_models, tmp_path):
    """A LoRA on every expert's w1 becomes 3-D lora_a/lora_b tensors llama.cpp applies per expert."""
    from conftest import write_recipe
    from moetool.api import assemble

    m = tiny_models("llama")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        f"""
name: mx
method: mofe
base_model: {m["base"]}
gate_mode: random
experts: [{{name: a, source: {m["e1"]}}}, {{name: b, source: {m["e2"]}}}, {{name: c, source: {m["e3"]}}}]
""",
    )
    moe = assemble(recipe, tmp_path / "moe")
    torch.manual_seed(1)
    tensors = {}
    for layer in range(2):
        for e in range(3):
            key = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts.{e}.w1"
            tensors[f"{key}.lora_A.weight"] = torch.randn(2, 32) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(48, 2) * 0.3
    ad = tmp_path / "ad"
    ad.mkdir()
    save_file(tensors, str(ad / "adapter_model.safetensors"))
    (ad / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "base_model_name_or_path": str(moe)})
    )
    man = export(ad, tmp_path / "gg")
    assert max(man["parity"]["max_abs_logit_diff"].values()) <= 1e-3
    del tensors["base_model.model.model.layers.1.block_sparse_moe.experts.2.w1.lora_A.weight"]
    del tensors["base_model.model.model.layers.1.block_sparse_moe.experts.2.w1.lora_B.weight"]
    save_file(tensors, str(ad / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match="needs all 3"):
        export(ad, tmp_path / "gg2")


def test_unsupported_adapters_are_refused(tiny_models, tmp_path):
    base = tiny_models("llama")["base"]
    _peft_adapter(base, tmp_path / "ad", targets=("q_proj",))
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": True}))
    with pytest.raises(ExportError, match="DoRA"):
        export(tmp_path / "ad", tmp_path / "o", base=base)
    assert not (tmp_path / "o").exists()
