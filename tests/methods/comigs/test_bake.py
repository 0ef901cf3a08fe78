"""Export: a trained user model baked into a Mixtral checkpoint computes the same logits (≤ 1e-5) after a reload
from disk by transformers; experts as PEFT adapters reproduce each expert alone in peft."""

from __future__ import annotations

import json

import pytest
import torch
from comigs_fixtures import recipe, tiny_base, user_data
from transformers import AutoModelForCausalLM

from moetool.errors import OutputExistsError
from moetool.methods.comigs.bake import bake, max_logit_diff, save_adapters
from moetool.methods.comigs.federated import prepare, run_inprocess, variant_recipe

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tiny_base(tmp_path_factory.mktemp("comigs-bake"))
    r = recipe(base, specialists=(1, 3, 0), rounds=2, router_every=2, router_steps=2)
    return base, run_inprocess(prepare(r, data=user_data(3)))


@pytest.mark.parametrize("user", [0, 1, 2], ids=["1G1S", "1G3S", "1G-only"])
def test_bake_parity(trained, tmp_path, user):
    base, fed = trained
    c = fed.clients[user]
    ids = c.data.test[:48].reshape(4, 12)
    report = bake(c.model, tmp_path / "mix", ids=ids, tokenizer_dir=base)
    assert report["parity_max_abs_logit_diff"] <= 1e-5
    mix = AutoModelForCausalLM.from_pretrained(str(tmp_path / "mix"), dtype=torch.float32)
    assert type(mix).__name__ == "MixtralForCausalLM"
    assert mix.config.num_local_experts == c.model.config.n_experts
    assert mix.config.num_experts_per_tok == min(2, c.model.config.n_experts)
    assert max_logit_diff(mix, c.model, ids) <= 1e-5
    # the LoRA really changed the model, so parity is not trivially base = base
    base_lm = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    assert max_logit_diff(base_lm, c.model, ids) > 1e-3
    assert json.loads((tmp_path / "mix" / "comigs-bake.json").read_text())["top_k"] == min(2, len(report["experts"]))
    assert (tmp_path / "mix" / "tokenizer.json").is_file()
    with pytest.raises(OutputExistsError):
        bake(c.model, tmp_path / "mix", ids=ids)


def test_bake_averaged_baseline(trained, tmp_path):
    _base, fed = trained
    r = variant_recipe(fed.recipe, "fedavg")
    c = run_inprocess(prepare(r.model_copy(update={"users": r.users[:1]}), data=user_data(1)), rounds=1).clients[0]
    report = bake(c.model, tmp_path / "mix", ids=c.data.test[:24].reshape(2, 12))
    assert report["parity_max_abs_logit_diff"] <= 1e-5


def test_saved_model_reloads_through_auto_classes(trained, tmp_path):
    _, fed = trained
    c = fed.clients[1]
    c.model.save_pretrained(str(tmp_path / "m"))
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    assert type(m).__name__ == "ComigsForCausalLM" and m.config.expert_names == c.model.config.expert_names
    assert max_logit_diff(m, c.model, c.data.test[:24].reshape(2, 12)) == 0.0


def test_peft_adapter_is_that_expert_alone(trained, tmp_path):
    peft = pytest.importorskip("peft")
    base, fed = trained
    c = fed.clients[1]
    dirs = save_adapters(c.model, tmp_path / "ad", base_model=str(base))
    assert [d.name for d in dirs] == c.model.config.expert_names
    j = 2
    ids = c.data.test[:24].reshape(2, 12)
    dense = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(dense, str(dirs[j])).eval()

    def only_j(moe):
        def fwd(h):
            flat = h.reshape(-1, h.shape[-1])
            return moe.expert_forward(flat, j, moe.base.gate_proj(flat), moe.base.up_proj(flat)).reshape(h.shape)

        return fwd

    # the CoMiGS model with every MoE layer replaced by expert j alone
    try:
        for m in c.model.moe_layers:
            m.forward = only_j(m)
        with torch.inference_mode():
            want = c.model(input_ids=ids).logits
            got = pm(input_ids=ids).logits
    finally:
        for m in c.model.moe_layers:
            del m.forward
    assert (got - want).abs().max() <= 1e-4


def test_expert_adapter_converts_to_gguf_lora_checked_in_llama_cpp(trained, tmp_path):
    pytest.importorskip("llama_cpp")
    from moetool.api import export

    base, fed = trained
    c = fed.clients[0]
    dirs = save_adapters(c.model, tmp_path / "ad", base_model=str(base))
    man = export(dirs[1], tmp_path / "gg", base=base)  # the user's specialist
    assert man["target"] == "gguf-lora" and man["scaling_folded_into_b"]  # rsLoRA α/√r folded for llama.cpp
    p = man["parity"]
    assert p["tokenizer_match"] and max(p["max_abs_logit_diff"].values()) <= 1e-3


def test_export_of_a_user_writes_the_bake_into_the_manifest_once(trained, tmp_path):
    """``moetool export <comigs-user>`` printed the bake parity but its manifest.json had no ``baked_from`` (added to
    the returned dict after the file was written) and named the deleted temporary bake folder as the model."""
    from moetool.api import export
    from moetool.io.files import copy_tokenizer

    base, fed = trained
    user = tmp_path / "user"
    fed.clients[1].model.save_pretrained(str(user))
    copy_tokenizer(base, user)
    man = export(user, tmp_path / "gg", target="gguf", quant="f32", verify=False)
    on_disk = json.loads((tmp_path / "gg" / "manifest.json").read_text())
    assert on_disk == json.loads(json.dumps(man))
    assert on_disk["baked_from"]["comigs_user"] == str(user)
    parity = on_disk["baked_from"]["parity"]  # an export.parity.ParityRecord: the bake held to its tolerance
    assert parity["max_abs_logit_diff"] <= 1e-5 and parity["tolerance"] == 1e-5 and parity["verdict"] == "pass"
    assert on_disk["model"]["path"] == str(user) and on_disk["model"]["name"] == "user"
    assert not list(tmp_path.glob(".gg.*"))  # the temporary bake is gone, and nothing names it
