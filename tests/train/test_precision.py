"""dtype end to end in router tuning: a bf16 MoE is tuned in bf16 (trainable weights float32) and written in bf16,
and its tuned routers stay within a stated tolerance of a float32 run's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tuning_fixtures import read_all_tensors, write_tuning_recipe

from conftest import save_dense
from moetool.api import assemble
from moetool.compute.dtypes import checkpoint_dtype, resolve_dtype
from moetool.errors import MoetoolError
from moetool.recipe import load_recipe
from moetool.train import precision
from moetool.train.precision import arithmetic_for
from moetool.train.router_tuning import train_router

# tuned router rows of a bf16 run against a float32 run of the same recipe, seed and batches: relative to each
# row's norm (bf16 rounds activations to 8 bits of mantissa; 8 steps compound it a little)
ROUTER_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def bf16_moe(tiny_models, tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    recipe = write_tuning_recipe(d, tiny_models("llama"), steps=8)
    text = recipe.read_text().replace("gate_mode: random\n", "gate_mode: random\ndtype: bfloat16\n")
    recipe.write_text(text)
    return load_recipe(recipe), assemble(recipe, d / "moe")


@pytest.mark.parametrize("native", [True, False], ids=["bf16-autocast", "float32-over-bf16"])
def test_a_bf16_moe_stays_bf16_and_matches_float32_tuning(bf16_moe, tmp_path, monkeypatch, native):
    """Both arithmetics a bf16 run can get (autocast where the device multiplies bf16 natively, float32 over the
    bf16 weights where it does not) tune routers within the tolerance of a float32 run."""
    recipe, moe = bf16_moe
    assert checkpoint_dtype(moe) == "bfloat16"
    monkeypatch.setattr(precision, "native_matmul", lambda dtype, device: native)
    train_router(recipe, moe, tmp_path / "bf16")  # auto: the checkpoint's dtype
    train_router(recipe, moe, tmp_path / "f32", dtype="float32")
    low, full = read_all_tensors(tmp_path / "bf16"), read_all_tensors(tmp_path / "f32")
    assert {t.dtype for t in low.values()} == {torch.bfloat16}, "the tuned folder is written in the input's dtype"
    assert {t.dtype for t in full.values()} == {torch.float32}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    meta = json.loads((tmp_path / "bf16" / "moetool.json").read_text())
    assert meta["training"]["dtype"] == "bfloat16"
    source = read_all_tensors(moe)
    routers = [k for k in low if k.endswith("block_sparse_moe.gate.weight")]
    assert routers
    for k in routers:
        a, b = low[k].float(), full[k].float()
        assert not torch.equal(a, source[k].float()), f"{k} did not train"
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max()
        assert rel < ROUTER_TOLERANCE, f"{k}: bf16 router rows differ from float32 by {rel:.3f} (relative)"
    for k in (k for k in low if ".experts." in k):  # frozen experts: the same bf16 bytes
        assert torch.equal(low[k], source[k])


def test_the_arithmetic_is_the_devices_fast_one(tiny_models, monkeypatch):
    from transformers import AutoModelForCausalLM

    from moetool.compute.upcast import native_matmul

    cpu = torch.device("cpu")
    assert native_matmul(torch.float32, cpu)
    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama")["base"], dtype=torch.bfloat16).requires_grad_(
        False
    )
    assert arithmetic_for(model, torch.float32, cpu).describe() == "float32"
    monkeypatch.setattr(precision, "native_matmul", lambda dtype, device: True)
    fast = arithmetic_for(model, torch.bfloat16, cpu)
    assert fast.upcast is None and fast.compute == torch.bfloat16 and "autocast" in fast.describe()
    monkeypatch.setattr(precision, "native_matmul", lambda dtype, device: False)
    upcast = arithmetic_for(model, torch.bfloat16, cpu)
    assert upcast.upcast is not None and upcast.compute == torch.float32
    assert "no native bfloat16 matmul" in upcast.describe()
    with torch.no_grad(), upcast.forward():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == torch.float32
    assert {p.dtype for n, p in model.named_parameters() if ".layers." in n} == {torch.bfloat16}


def test_unknown_dtype_is_refused(bf16_moe):
    _, moe = bf16_moe
    assert resolve_dtype("float32", moe) == torch.float32
    with pytest.raises(MoetoolError, match="--dtype 'int8'"):
        resolve_dtype("int8", moe)


@pytest.mark.parametrize("native", [True, False], ids=["bf16-arithmetic", "float32-over-bf16"])
def test_eval_runs_in_the_models_own_dtype(bf16_moe, tmp_path, monkeypatch, native):
    """``moetool eval`` used to upcast every model to float32 on the CPU; a bf16 MoE is now held in bf16 (said in the
    report) and computes in bf16 where the device multiplies it natively, else in float32 one layer at a time: within
    a stated tolerance of a float32 evaluation, and exactly it for the float32 arithmetic."""
    from moetool.api import evaluate
    from moetool.compute import upcast

    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(upcast, "native_matmul", lambda dtype, device: native)
    _, moe = bf16_moe
    data = {"code": moe.parent / "code.txt"}
    low = evaluate([str(moe)], data=data, seq_len=32, max_tokens=512)
    full = evaluate([str(moe)], data=data, seq_len=32, max_tokens=512, dtype="float32", device="cpu")
    ran, ref = low["models"][str(moe)], full["models"][str(moe)]
    assert ran["dtype"] == "bfloat16" and ref["dtype"] == "float32"
    assert ran["arithmetic"] == ("bfloat16" if native else "float32") and ref["arithmetic"] == "float32"
    a, b = low["perplexity"][str(moe)]["code"], full["perplexity"][str(moe)]["code"]
    assert abs(a - b) / b < (0.02 if native else 1e-5), (a, b)  # the same bf16 weights; bf16 activations round


@pytest.mark.parametrize(
    ("env", "value", "what"),
    [("MOETOOL_MEMORY_BUDGET", "1M", "of memory"), ("MOETOOL_DISK_BUDGET", "10K", "MOETOOL_DISK_BUDGET")],
)
def test_stages_that_cannot_fit_say_so_before_they_start(bf16_moe, tmp_path, monkeypatch, env, value, what):
    """Tuning, evaluation and GGUF export check their memory and disk need against what is available (here an
    artificially small budget) and refuse up front, naming the need and the way out, with nothing written."""
    from moetool.api import evaluate, export
    from moetool.io.budget import BudgetError

    recipe, moe = bf16_moe
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(env, value)
    with pytest.raises(BudgetError, match=rf"router tuning (needs|writes) about .*{what}.*nothing was written"):
        train_router(recipe, moe, tmp_path / "tuned")
    assert not (tmp_path / "tuned").exists() and not list(tmp_path.glob(".tuned*"))
    with pytest.raises(BudgetError, match=rf"GGUF export \(q8_0\) (needs|writes) about .*{what}"):
        export(moe, tmp_path / "gguf", quant="q8_0")
    assert not (tmp_path / "gguf").exists()
    if env == "MOETOOL_MEMORY_BUDGET":
        with pytest.raises(BudgetError, match=r"onnx export needs about .*written one layer at a time"):
            export(moe, tmp_path / "onnx", target="onnx", quant="f32")
        assert not (tmp_path / "onnx").exists()
        with pytest.raises(BudgetError, match="evaluating .* needs about .*--dtype bfloat16"):
            evaluate([str(moe)], data={"code": moe.parent / "code.txt"}, seq_len=32, max_tokens=256)


def test_budget_sizes():
    from moetool.io.budget import BudgetError, parse_size

    assert parse_size("8G", what="x") == 8 << 30 and parse_size("512M", what="x") == 512 << 20
    assert parse_size("1024", what="x") == 1024 and parse_size("1.5GiB", what="x") == int(1.5 * (1 << 30))
    with pytest.raises(BudgetError, match="not a size"):
        parse_size("lots", what="MOETOOL_MEMORY_BUDGET")


def test_gguf_verification_holds_the_models_bf16_when_float32_does_not_fit(tmp_path, monkeypatch):
    """A budget that holds the bf16 model but not its float32 copy: verification holds the weights in bf16 and
    computes in float32, one layer at a time (said in the manifest), instead of refusing; its figures against the
    source equal a float32 reference's. With room for float32 twice over it holds float32."""
    from moetool.api import export
    from moetool.export.reference import VERIFY_OVERHEAD

    # deep and narrow, as real models are: one float32 layer is a small part of the whole
    root = tmp_path / "deep"
    base = save_dense(root / "base", num_hidden_layers=4, tie_word_embeddings=True)
    family = {"base": base} | {f"e{i}": save_dense(root / f"e{i}", seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)}
    recipe = write_tuning_recipe(root, family, steps=1)
    recipe.write_text(recipe.read_text().replace("gate_mode: random\n", "gate_mode: random\ndtype: bfloat16\n"))
    moe = assemble(recipe, root / "moe")
    params = sum(t.numel() for t in load_file(str(next(moe.glob("*.safetensors")))).values())
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(int(VERIFY_OVERHEAD + params * 3.5)))
    low = export(moe, tmp_path / "low", quant="q8_0")["parity"]
    assert low["reference"] == "transformers float32, layer by layer over bfloat16 weights"
    assert low["conversion"]["reference"] == (
        "transformers float32, layer by layer over float16 weights, on the artifact's dequantized weights"
    )
    assert low["conversion"]["top1_agreement"] >= 0.95
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str(2 * (VERIFY_OVERHEAD + params * 4)))
    full = export(moe, tmp_path / "full", quant="q8_0")["parity"]
    assert full["reference"] == "transformers float32"
    for n, diff in full["max_abs_logit_diff"].items():  # the same source weights, the same arithmetic
        assert low["max_abs_logit_diff"][n] == pytest.approx(diff, abs=1e-4)
    assert low["ppl_reference"] == pytest.approx(full["ppl_reference"], rel=1e-5)
