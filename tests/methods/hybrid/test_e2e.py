"""Hybrid end to end on tiny experts (a llama and a Mamba sharing a tokenizer): merge, profile, sweep, export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hybrid_tiny_models import save_mamba, save_pair, write_texts

from moetool.errors import MoetoolError, OutputExistsError, RecipeError
from moetool.recipe import load_recipe

RECIPE = """\
name: tiny-hybrid
method: hybrid
experts:
  - {{name: llama, source: {llama}}}
  - {{name: mamba, source: {mamba}}}
router:
  max_length: 32
  hidden_size: 8
train:
  data:
    alpha: {{text: {alpha}}}
    beta: {{text: {beta}}}
  min_length: 4
  samples_per_domain: 24
  valid_samples_per_domain: 16
  epochs: 5
  batch_size: 16
profile:
  lengths: [8, 16, 32]
  repeats: 1
sweep:
  values: [0.0, 4.0]
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hybrid")
    llama, mamba = save_pair(root)
    texts = write_texts(root)
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE.format(llama=llama, mamba=mamba, alpha=texts["alpha"], beta=texts["beta"]))
    from moetool import api

    assert api.plugin(api.load(recipe)).name == "hybrid"
    out = api.assemble(recipe, root / "model")
    return {"root": root, "recipe": recipe, "model": out, "llama": llama, "mamba": mamba}


def test_merge_writes_a_hybrid_model(built):
    from moetool.methods.hybrid.assemble import read_model
    from moetool.methods.hybrid.router import router_param_count

    meta, router = read_model(built["model"])
    assert [e["model_type"] for e in meta["experts"]] == ["llama", "mamba"]
    assert [e["kind"] for e in meta["experts"]] == ["attention", "ssm"]
    rc = meta["router"]
    assert rc["in_features"] == 1 + 2 + 32  # length, two domains, the llama's hidden size
    assert router.trainable_parameters() == rc["parameters"] == router_param_count(35, 8, 2)
    rows = meta["held_out"]["rows"]
    # the oracle picks the better expert per request, so it is never worse than either expert alone
    assert rows["oracle"]["nll"] <= min(rows["llama alone"]["nll"], rows["mamba alone"]["nll"]) + 1e-9
    assert rows["llama alone"]["costly_share"] in (0.0, 1.0) and rows["mamba alone"]["costly_share"] in (0.0, 1.0)
    prof = json.loads((built["model"] / "latency_profile.json").read_text())
    assert set(prof["experts"]) == {"llama", "mamba"} and all(s > 0 for s in prof["experts"]["llama"]["seconds"])
    with pytest.raises(OutputExistsError):
        from moetool import api

        api.assemble(built["recipe"], built["model"])


def test_expert_interface_and_fast_scan(built):
    from moetool.methods.hybrid.experts import load_expert
    from moetool.methods.hybrid.zoo_mamba import check_fast_scan

    m = load_expert("mamba", str(built["mamba"]))
    ids = torch.randint(0, 300, (2, 20))
    assert check_fast_scan(m.model, ids) < 1e-5
    with torch.no_grad():
        ref = torch.log_softmax(m.model(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(m.token_logp(ids), ref, atol=1e-5)
    assert m.encode(ids).shape == (2, 20, 16)


def test_tokenizer_mismatch_is_refused(built, tmp_path):
    from moetool.methods.hybrid.experts import check_tokenizers, load_expert

    other = save_mamba(tmp_path / "other")
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "e", "t"  # swap two ids: same size, different mapping
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    experts = [load_expert("llama", str(built["llama"])), load_expert("other", str(other))]
    with pytest.raises(MoetoolError, match=r"experts 'llama' .* and 'other' .* use different tokenizers"):
        check_tokenizers(experts)


def test_router_export_parity_and_dispatcher(built, tmp_path):
    import onnxruntime as ort

    from moetool.methods.hybrid.assemble import read_model
    from moetool.methods.hybrid.export import export_hybrid

    m = export_hybrid(built["model"], tmp_path / "export", quant="f32")
    par = m["router"]["parity"]
    assert par["requests"] == 64 and par["max_abs_score_diff"] < 1e-5 and par["choice_agreement"] == 1.0
    # the router graph alone, fed by hand: same choice as the PyTorch router on the same request
    _meta, router = read_model(built["model"])
    sess = ort.InferenceSession(str(tmp_path / "export" / "router.onnx"), providers=["CPUExecutionProvider"])
    ids = [1, 17, 40, 99, 5, 250, 33]
    scores, choice = sess.run(None, {"input_ids": np.array([ids]), "domain": np.array([[0, 1]], dtype=np.float32)})
    from transformers import AutoModelForCausalLM

    emb = AutoModelForCausalLM.from_pretrained(str(built["llama"])).get_input_embeddings()
    feats = torch.cat([torch.tensor([[7 / 32, 0.0, 1.0]]), emb(torch.tensor([ids])).mean(1)], dim=-1)
    assert np.allclose(scores, router.scores(feats).detach().numpy(), atol=1e-5)
    assert int(choice[0]) == int(router.choose(feats)[0])
    # each expert went through an exporter and was verified in llama.cpp
    by_name = {e["name"]: e for e in m["experts"]}
    assert by_name["mamba"]["parity"]["top1_agreement"] == 1.0
    assert by_name["llama"]["parity"]["top1_agreement"] >= 0.99
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("hybrid_dispatch", tmp_path / "export" / "dispatch.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hybrid_dispatch"] = mod
    spec.loader.exec_module(mod)
    d = mod.Dispatcher(tmp_path / "export")
    res = d("def main(): import os", domain="alpha")
    k, _ = d.route(d.ids("def main(): import os"), "alpha")
    assert res["expert"] == ["llama", "mamba"][k] and res["tokens"] == len(d.ids("def main(): import os"))


def test_pareto_sweep_and_latency_check(built, tmp_path):
    from moetool.methods.hybrid.pareto import sweep, table, write_sweep
    from moetool.methods.hybrid.pipeline import prepare

    r = load_recipe(built["recipe"])
    p = prepare(r, built["root"], cache=tmp_path / "outputs.safetensors")
    again = prepare(r, built["root"], cache=tmp_path / "outputs.safetensors")  # requests and outputs from the cache
    assert torch.equal(again.train.logp, p.train.logp) and torch.equal(again.valid_requests.ids, p.valid_requests.ids)
    res = sweep(p, timed_requests=6, repeats=2)
    assert [row["lambda_penalty"] for row in res["rows"]] == [0.0, 4.0]
    assert all(0.0 <= row["costly_share"] <= 1.0 for row in res["rows"])  # monotonicity: test_hybrid_sweep.py
    for row in res["rows"]:
        assert row["measured_latency_ms"] > 0 and row["sum_share_latency_ms"] > 0 and "latency_check" in row
        assert row["soft_nll"] > 0
    out = write_sweep(res, tmp_path / "pareto")
    assert (out / "pareto.png").stat().st_size > 1000 and "oracle" in table(res)


def test_recipe_errors_name_field_and_line(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(
        "name: x\nmethod: hybrid\nexperts:\n  - {name: a, source: zoo:base}\n  - {name: b, source: zoo:mamba}\n"
        "costly: c\n"
    )
    with pytest.raises(RecipeError, match=r"r.yaml:6: costly: 'c' is not an expert"):
        load_recipe(p)
    p.write_text(
        "name: x\nmethod: hybrid\nexperts:\n  - {name: a, source: zoo:base}\n  - {name: b, source: zoo:mamba}\n"
        "router:\n  decision: utility\n"
    )
    with pytest.raises(RecipeError, match="router.decision: 'utility' needs router.utility_head"):
        load_recipe(p)


def test_profile_fit_and_device_file(built, tmp_path):
    from typer.testing import CliRunner

    from moetool.cli import app
    from moetool.methods.hybrid.profile import fit_latency, read_profile

    lengths = [16, 32, 64, 128, 256]
    secs = [2e-5 * n + 3e-8 * n * n + 1e-3 for n in lengths]
    fit = fit_latency(lengths, secs)
    assert fit["a"] == pytest.approx(2e-5, rel=1e-6) and fit["b"] == pytest.approx(3e-8, rel=1e-5)
    assert fit["c0"] == pytest.approx(1e-3, rel=1e-6) and fit["max_rel_error"] < 1e-9
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "pi", "experts": {"llama": {"lengths": [1, 2], "seconds": [0.1, 0.2]}}}))
    with pytest.raises(MoetoolError, match=r"bad.json: experts.mamba: missing"):
        read_profile(bad, ["llama", "mamba"])
    dev = tmp_path / "pi.json"
    dev.write_text(
        json.dumps(
            {
                "device": "raspberry-pi-4",
                "experts": {
                    "llama": {"lengths": lengths, "seconds": [10 * s for s in secs]},
                    "mamba": {"lengths": lengths, "seconds": secs},
                },
            }
        )
    )
    runner = CliRunner()
    res = runner.invoke(app, ["profile", str(built["model"]), "--from", str(dev), "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    stored = json.loads((tmp_path / "p.json").read_text())
    assert stored["device"] == "raspberry-pi-4" and stored["experts"]["llama"]["fit"]["b"] == pytest.approx(3e-7)
    again = runner.invoke(app, ["profile", str(built["model"]), "--from", str(dev), "-o", str(tmp_path / "p.json")])
    assert again.exit_code == 2 and "--force" in again.output
    # --for names the device the profile is for (--device, its old spelling, is read with a deprecation line)
    for option, device in (("--for", "pi-5"), ("--device", "pi-4")):
        args = ["profile", str(built["model"]), "--from", str(dev), "-o", str(tmp_path / "p.json"), "--force"]
        res = runner.invoke(app, [*args, option, device])
        assert res.exit_code == 0, res.output
        assert json.loads((tmp_path / "p.json").read_text())["device"] == device


def test_cli_dry_run_and_pareto(built, tmp_path):
    from typer.testing import CliRunner

    from moetool.cli import app

    runner = CliRunner()
    dry = runner.invoke(app, ["merge", str(built["recipe"]), "--dry-run"])
    assert dry.exit_code == 0 and "hybrid 'tiny-hybrid'" in dry.output and "llama" in dry.output
    res = runner.invoke(
        app,
        [
            "hybrid",
            "pareto",
            str(built["recipe"]),
            "-o",
            str(tmp_path / "p"),
            "--values",
            "0,2",
            "--timed-requests",
            "0",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "p" / "pareto.json").read_text())
    assert [r["lambda_penalty"] for r in data["rows"]] == [0.0, 2.0] and (tmp_path / "p" / "pareto.png").is_file()
    bad = runner.invoke(
        app, ["hybrid", "pareto", str(built["recipe"]), "-o", str(tmp_path / "q"), "--parameter", "lambda_typo"]
    )
    assert bad.exit_code == 2 and "--parameter" in bad.output


def test_per_token_routing_end_to_end(built, tmp_path):
    """granularity: token on the real (tiny) experts: causal per-token features, a feature-input router graph."""
    from moetool import api
    from moetool.methods.hybrid.export import export_hybrid

    text = built["recipe"].read_text().replace("  hidden_size: 8\n", "  hidden_size: 8\n  granularity: token\n")
    recipe = built["root"] / "token.yaml"
    recipe.write_text(text)
    out = api.assemble(recipe, tmp_path / "token-model")
    meta = json.loads((out / "hybrid.json").read_text())
    rows = meta["held_out"]["rows"]
    assert meta["router"]["granularity"] == "token"
    # per token both experts keep their state over the prefix: the router's latency is the sum of both experts'
    both = rows["llama alone"]["expected_latency_ms"] + rows["mamba alone"]["expected_latency_ms"]
    assert rows["router"]["expected_latency_ms"] == pytest.approx(both, rel=1e-5)
    assert rows["oracle"]["nll"] <= min(rows["llama alone"]["nll"], rows["mamba alone"]["nll"])
    m = export_hybrid(out, tmp_path / "token-export", experts=False)
    assert m["router"]["inputs"] == ["features"] and not m["router"]["self_contained"]
    assert m["router"]["parity"]["max_abs_score_diff"] < 1e-5 and m["router"]["parity"]["choice_agreement"] == 1.0


def test_mamba_gguf_refuses_unknown_tensors():
    from moetool.export.base import ExportError
    from moetool.export.gguf.mamba import gguf_tensors

    state = {"backbone.embeddings.weight": torch.zeros(4, 2), "backbone.layers.0.mixer.A_log": torch.zeros(3, 2)}
    names = dict(gguf_tensors(state, tied=True))
    assert np.allclose(names["blk.0.ssm_a"], -1.0)  # A = -exp(A_log)
    with pytest.raises(ExportError, match="backbone.layers.0.mixer.new_thing"):
        gguf_tensors({"backbone.layers.0.mixer.new_thing": torch.zeros(2)}, tied=True)
