"""Importance matrices for GGUF export: llama.cpp's format and bytes, every expert weighted, low-bit types refused
without one, and the bits-by-importance plan within its budget."""

from __future__ import annotations

import json

import gguf
import llama_cpp  # noqa: F401  (the dev extra installs it; a missing runtime must fail, not skip)
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import save_dense, write_recipe
from moetool.api import assemble, export, plan_export
from moetool.export import ExportError
from moetool.export.gguf import ggml
from moetool.quant.imatrix import Calibration, ImatrixError, ImportanceMatrix, load
from moetool.quant.plan import parse_quant
from moetool.quant.types import NEEDS_IMATRIX, TYPES

WIDE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    tie_word_embeddings=True,
)
TEXT = ("def main():\n    return parse(line) + 1\n" * 40) + ("Permission is hereby granted, free of charge, " * 40)


def _moe(root, top_k=2):
    base = save_dense(root / "base", "llama", **WIDE)
    paths = [save_dense(root / f"e{i}", "llama", seed=i, base=base, mlp_noise=0.3, **WIDE) for i in (1, 2, 3)]
    experts = "".join(
        f"  - {{name: {n}, source: {p}, positive_prompts: ['{n} text']}}\n"
        for n, p in zip(("code", "legal", "medical"), paths, strict=True)
    )
    text = f"name: w\nmethod: mofe\nbase_model: {base}\nexperts_per_token: {top_k}\nexperts:\n{experts}"
    return assemble(write_recipe(root / f"r{top_k}.yaml", text), root / f"moe{top_k}")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return _moe(tmp_path_factory.mktemp("wide"))


def _calib(**kw):
    return Calibration({"mix": TEXT}, source="test", **kw)


def _tensor_bytes(path, name):
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return t.tensor_type.name.lower(), np.asarray(t.data).tobytes()


def test_experts_bytes_are_llama_cpps_with_the_importance_of_each_expert(wide, tmp_path):
    """The GGUF's expert tensor equals ggml's quantizer run per expert with that expert's importance row (the
    route llama.cpp's own quantizer takes), and differs from the unweighted rounding."""
    m = export(wide, tmp_path / "im", quant="experts=q4_k,router=f32,*=q8_0", imatrix=_calib(), verify=False)
    plain = export(wide, tmp_path / "plain", quant="experts=q4_k,router=f32,*=q8_0", verify=False)
    im = load(tmp_path / "im" / m["imatrix"]["file"])
    src = load_file(str(wide / "model.safetensors"))
    for proj, w in (("down", "w2"), ("gate", "w1")):
        name = f"blk.1.ffn_{proj}_exps.weight"
        typ, got = _tensor_bytes(tmp_path / "im" / m["file"], name)
        assert typ == "q4_k"
        values = im.entries[name].values().reshape(3, -1)
        want = b"".join(
            ggml.quantize(
                src[f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"].float().numpy(), "q4_k", values[e]
            )
            for e in range(3)
        )
        assert got == want
        assert _tensor_bytes(tmp_path / "plain" / plain["file"], name)[1] != got
    assert "imatrix" not in plain and m["imatrix"]["tensors_weighted"]


def test_the_imatrix_file_is_llama_cpps_format_and_reads_back(wide, tmp_path):
    m = export(wide, tmp_path / "a", quant="experts=q4_k,router=f32,*=q8_0", imatrix=_calib(), verify=False)
    path = tmp_path / "a" / m["imatrix"]["file"]
    assert path.name.endswith(".imatrix.gguf") and m["imatrix"]["file"] in m["files"]
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.type"].contents() == "imatrix"
    assert "general.architecture" not in r.fields
    for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
        assert r.fields[key].types == [gguf.GGUFValueType.UINT32]
    assert r.fields["imatrix.datasets"].contents() == ["mix"]
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    assert shapes["blk.0.ffn_down_exps.weight.in_sum2"] == [512, 3]  # ne: n_per_row, n_expert
    assert shapes["blk.0.ffn_down_exps.weight.counts"] == [1, 3]
    assert shapes["blk.0.attn_q.weight.in_sum2"] == [256]  # one matrix: 1-D, as llama-imatrix writes it
    # the same statistics through --imatrix FILE give the same GGUF, byte for byte
    again = export(wide, tmp_path / "b", quant="experts=q4_k,router=f32,*=q8_0", imatrix=path, verify=False)
    assert (tmp_path / "b" / again["file"]).read_bytes() == (tmp_path / "a" / m["file"]).read_bytes()


def test_an_expert_the_router_never_picks_still_gets_importance(tmp_path):
    """Top-1 routing with router rows w, -w and 0.01·w: expert 2 is never chosen. llama.cpp's collection leaves it
    without data (weight 1); moetool's floor computes it on every token."""
    moe = _moe(tmp_path, top_k=1)
    weights = load_file(str(moe / "model.safetensors"))
    for layer in range(2):
        key = f"model.layers.{layer}.block_sparse_moe.gate.weight"
        w = torch.randn(WIDE["hidden_size"])
        weights[key] = torch.stack([w, -w, 0.01 * w]).to(weights[key].dtype)
    save_file(weights, str(moe / "model.safetensors"), metadata={"format": "pt"})
    from moetool.export.gguf.imatrix import collect

    wanted = {f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up", "down")}
    bare = collect(moe, _calib(min_tokens=0), wanted, device="cpu")
    assert bare.starved() == {n: [2] for n in wanted}
    np.testing.assert_array_equal(bare.entries["blk.0.ffn_down_exps.weight"].values().reshape(3, -1)[2], 1.0)
    m = export(moe, tmp_path / "g", quant="experts=q4_k,router=f32,*=q8_0", imatrix=_calib(), verify=False)
    tokens = m["imatrix"]["expert_tokens"]["0"]
    assert tokens["routed"][2] == 0 and tokens["used"][2] == sum(m["imatrix"]["tokens"].values())
    im = load(tmp_path / "g" / m["imatrix"]["file"])
    assert not im.starved() and not np.allclose(im.entries["blk.0.ffn_down_exps.weight"].values()[-512:], 1.0)
    with pytest.raises(ImatrixError, match=r"no data for expert\(s\) \[2\]"):
        export(moe, tmp_path / "h", quant="experts=q4_k,router=f32,*=q8_0", imatrix=_calib(min_tokens=0))
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("low", ["q3_k", "q2_k", "iq4_xs", "iq3_s"])
def test_low_bit_types_are_refused_without_an_imatrix(wide, tmp_path, low):
    with pytest.raises(ExportError, match="--imatrix auto"):
        export(wide, tmp_path / "x", quant=f"experts={low},router=f32,*=q8_0")
    assert not (tmp_path / "x").exists()
    assert low in NEEDS_IMATRIX


def test_low_bit_experts_with_an_imatrix_are_written_and_pass_parity(wide, tmp_path):
    m = export(wide, tmp_path / "q", quant="experts=iq4_xs,router=f32,*=q8_0", imatrix=_calib())
    assert _tensor_bytes(tmp_path / "q" / m["file"], "blk.0.ffn_up_exps.weight")[0] == "iq4_xs"
    assert m["parity"]["tokenizer_match"] and np.isfinite(m["parity"]["ppl_artifact"])


def test_imatrix_options_are_checked_before_any_work(wide, tmp_path):
    with pytest.raises(ExportError, match="gguf target"):
        plan_export(wide, tmp_path / "o", target="onnx", imatrix="auto", calibration=TEXT)
    with pytest.raises(ExportError, match="is for --imatrix auto"):
        plan_export(wide, tmp_path / "o", calibration=TEXT)
    with pytest.raises(ExportError, match="no such file"):
        plan_export(wide, tmp_path / "o", imatrix=str(tmp_path / "missing.imatrix.gguf"))
    with pytest.raises(ExportError, match="--imatrix-mode"):
        plan_export(wide, tmp_path / "o", imatrix="auto", calibration=TEXT, imatrix_mode="sometimes")
    other = ImportanceMatrix(datasets=["x"])
    other.add("blk.0.ffn_down_exps.weight", np.ones((3, 64)), np.ones(3))
    other.save(tmp_path / "other.imatrix.gguf")
    with pytest.raises(ImatrixError, match="another model"):
        export(wide, tmp_path / "o", quant="experts=q4_k,router=f32,*=q8_0", imatrix=tmp_path / "other.imatrix.gguf")
    assert not (tmp_path / "o").exists()


def test_the_allocated_plan_fits_its_budget_and_says_why(wide, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    q8 = export(wide, tmp_path / "q8", quant="q8_0", verify=False)["plan"]["total_bytes"]
    budget = int(q8 * 0.55)
    m = export(wide, tmp_path / "a", quant=f"budget={budget},embeddings=q8_0", imatrix=_calib(), verify=False)
    alloc = m["allocation"]
    assert alloc["tensor_bytes"] <= budget == alloc["budget"]
    assert m["plan"]["total_bytes"] == alloc["tensor_bytes"]
    banks = {b["tensor"]: b for b in alloc["banks"]}
    assert "token_embd.weight" not in banks and "blk.0.ffn_gate_inp.weight" not in banks  # pinned by rule / router
    types = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(str(tmp_path / "a" / m["file"])).tensors}
    assert all(types[n] == b["type"] for n, b in banks.items())
    assert len({b["type"] for b in banks.values()}) > 1  # bits differ by sensitivity
    assert all(b["why"] and b["kl_measured"] and min(b["kl_measured"].values()) > -1e-6 for b in banks.values())
    from moetool.paths import cache_dir

    (entry,) = (cache_dir() / "allocation").glob("*.json")  # the measurements, kept for another budget
    entry.write_text("not json")  # a damaged entry is measured again
    with pytest.raises(ExportError, match="cheapest plan needs"):
        export(wide, tmp_path / "b", quant="budget=10000,embeddings=q8_0", imatrix=_calib(), verify=False)
    assert json.loads(entry.read_text())[0]["kl"]
    with pytest.raises(ExportError, match="--imatrix auto"):
        export(wide, tmp_path / "c", quant=f"budget={budget}", verify=False)


def test_types_and_budget_parse():
    for name, t in TYPES.items():
        if not t.is_float:
            assert gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, name.upper())] == (t.block, t.block_bytes)
    spec = parse_quant("budget=190M,router=f32")
    assert spec.budget == 190 << 20 and spec.label() == "alloc-199mb"
    e = ImportanceMatrix()
    e.add("t", np.array([[4.0, 8.0], [1.0, 1.0]]), np.array([2.0, 0.0]))
    np.testing.assert_array_equal(e.entries["t"].values(), [2.0, 4.0, 1.0, 1.0])


def test_the_cli_collects_writes_and_reports_the_imatrix(wide, tmp_path):
    from typer.testing import CliRunner

    from moetool.cli import app

    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    out = tmp_path / "cli"
    args = ["export", str(wide), "-o", str(out), "--quant", "experts=q3_k,router=f32,*=q8_0", "--no-verify"]
    r = CliRunner().invoke(app, [*args, "--imatrix", "auto", "--calibration", str(calib), "--imatrix-mode", "all"])
    assert r.exit_code == 0, r.output
    assert "imatrix: w.imatrix.gguf (all," in " ".join(r.output.split())
    assert (out / "w.imatrix.gguf").is_file()
    r = CliRunner().invoke(app, [*args[:2], "-o", str(tmp_path / "x"), *args[4:]])
    assert r.exit_code == 2 and "--imatrix auto" in r.output and not (tmp_path / "x").exists()
    r = CliRunner().invoke(app, [*args[:2], "-o", str(tmp_path / "y"), "--calibration", str(calib)])
    assert r.exit_code == 2 and "--calibration is for --imatrix auto" in " ".join(r.output.split())


def test_a_model_that_does_not_fit_is_streamed_with_the_resident_statistics(tmp_path, monkeypatch):
    """Collection on the CPU streams the decoder layers from disk (several windows per pass) when the resident
    model does not fit the memory available, as ``moetool eval`` does, and gives the resident importance."""
    from tuning_fixtures import write_tuning_recipe

    from moetool.eval.residency import eval_need
    from moetool.export.gguf.imatrix import collect

    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    # deep and narrow, as real models are: one layer is a small part of the whole
    root = tmp_path / "deep"
    base = save_dense(root / "base", num_hidden_layers=8, tie_word_embeddings=True)
    family = {"base": base} | {f"e{i}": save_dense(root / f"e{i}", seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)}
    moe = assemble(write_tuning_recipe(root, family, steps=1), root / "moe")
    m = export(moe, tmp_path / "im", quant="experts=q4_k,router=f32,*=q8_0", imatrix=_calib(), verify=False)
    want = load(tmp_path / "im" / m["imatrix"]["file"])
    seq = _calib().seq_len
    resident = eval_need(moe, dtype="auto", seq_len=seq, batch_size=1).memory
    streamed = eval_need(moe, dtype="auto", seq_len=seq, batch_size=1, streamed=True).memory
    assert streamed < resident
    monkeypatch.setenv("MOETOOL_MEMORY_BUDGET", str((resident + streamed) // 2))
    got = collect(moe, _calib(), set(want.entries))
    assert str(got.info["held"]).startswith("the resident model needs about")
    assert set(got.entries) == set(want.entries)
    for name, entry in want.entries.items():
        np.testing.assert_array_equal(got.entries[name].counts, entry.counts)
        np.testing.assert_allclose(got.entries[name].sums, entry.sums, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize(
    ("quant", "weighted"),
    [("experts=q4_k,attention=q6_k,router=f32,*=q8_0", False), ("experts=iq4_xs,router=f32,*=q5_k", True)],
)
def test_every_tensor_is_llama_quantizes_bytes_with_no_float32_copy_written(wide, tmp_path, quant, weighted):
    """Tensor by tensor through ggml's quantizer (two threads) gives the bytes of llama.cpp's whole-file quantizer
    run on a float32 GGUF of the same model, with and without importance; no staging file is left beside it."""
    from support.llama_quantize import llama_quantize, tensors

    im = dict(imatrix=_calib()) if weighted else {}
    ours = export(wide, tmp_path / "ours", quant=quant, verify=False, **im)
    written = {f.name for f in (tmp_path / "ours").glob("*.gguf")}
    assert written == {ours["file"], *([ours["imatrix"]["file"]] if weighted else [])}
    f32 = export(wide, tmp_path / "f32", quant="f32", verify=False)
    got = tensors(tmp_path / "ours" / ours["file"])
    imatrix = load(tmp_path / "ours" / ours["imatrix"]["file"]) if weighted else None
    llama_quantize(tmp_path / "f32" / f32["file"], tmp_path / "ref.gguf", {n: t for n, (t, _) in got.items()}, imatrix)
    want = tensors(tmp_path / "ref.gguf")
    assert set(got) == set(want)
    assert {t for t, _ in got.values()} >= ({"iq4_xs", "q5_k"} if weighted else {"q4_k", "q6_k", "q8_0"})
    for name, (ty, data) in want.items():
        assert got[name] == (ty, data), name
