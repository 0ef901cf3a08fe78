"""Token-level GEM end to end on tiny models: assembly parity, router training and QAT with frozen weights checked,
SCAR causality, the GEM evaluation, and the ONNX graph (threshold rule and SCAR inside) against PyTorch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gem_fixtures import domain_text, make_gem_inputs, recipe_text

from moetool.errors import OutputExistsError

DOMAINS = ("code", "legal", "medical")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from moetool.api import assemble

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gem")
    paths = make_gem_inputs(root)
    extra = (
        "qat:\n  steps: 6\n  batch_size: 2\n  seq_len: 32\n  learning_rate: 0.001\n"
        "scar:\n  clusters: 3\n  iterations: 5\n"
    )
    recipe = root / "gem.yaml"
    recipe.write_text(recipe_text(paths, extra=extra))
    out = assemble(recipe, root / "out")
    return paths, recipe, out


def _load(out: Path):
    from transformers import AutoModelForCausalLM

    import moetool.methods.gem.model  # noqa: F401  (registers its model class)

    return AutoModelForCausalLM.from_pretrained(str(out)).eval()


def test_assembly_report_and_reload(built):
    paths, _recipe, out = built
    rep = json.loads((out / "gem-report.json").read_text())
    assert rep["assembly_parity"] == {"general": 0.0, "code": 0.0, "legal": 0.0, "medical": 0.0}
    assert rep["router_training"]["frozen_unchanged"] > 0
    by_tau = {r["tau"]: r for r in rep["router"]["by_tau"]}
    assert by_tau[0.0]["fallback"] == 0.0
    assert rep["router"]["argmax_accuracy"] > 0.45  # three domains: chance is 1/3
    fallbacks = [r["fallback"] for r in rep["router"]["by_tau"]]
    assert fallbacks == sorted(fallbacks)  # a higher tau never routes more tokens
    assert set(rep["memory"]["devices"]) == {"raspberry-pi-4", "pixel-6", "iphone-13"}
    assert rep["memory"]["by_role"]["experts"]["types"]  # the pathways have their own (4-bit) role
    q = rep["qat"]
    assert q["steps"] == 6 and q["frozen_unchanged"] > 0 and set(q["before"]) == {"float", "fake_quant"}
    # the reloaded checkpoint is the model: forced pathways reproduce their source models
    from transformers import AutoModelForCausalLM

    model = _load(out)
    assert type(model).__name__ == "GemForCausalLM" and model.config.domains == list(DOMAINS)
    model.config.scar_clusters = 0
    ids = torch.randint(4, 300, (1, 24))
    for p, name in enumerate(("general", "code")):
        ref = AutoModelForCausalLM.from_pretrained(str(paths[name])).eval()
        got = model(ids, route=torch.full_like(ids, p)).logits
        diff = float((got - ref(ids).logits).abs().max())
        # general is untouched by QAT (exact); the code pathway moved a little under QAT
        assert diff == 0.0 if name == "general" else 0 < diff < 1.0


def test_existing_output_is_refused(built):
    from moetool.api import assemble

    _, recipe, out = built
    with pytest.raises(OutputExistsError, match="--force"):
        assemble(recipe, out)


def _fresh_model(paths):
    from moetool.methods.gem.pathways import build_token_model, resolve_pathways
    from moetool.recipe.load import load_recipe

    r = load_recipe(paths["recipe"])
    return build_token_model(resolve_pathways(r, None), r)[0], r


@pytest.fixture
def fresh(built, tmp_path):
    paths, recipe, _ = built
    return _fresh_model(paths | {"recipe": recipe})


def test_router_training_moves_only_the_router(fresh, built):
    from transformers import AutoTokenizer

    from moetool.methods.gem.router import gem_encoder, train_router
    from moetool.recipe.gem import GemRouterSpec
    from moetool.train.data import tokenize_stream

    model, _ = fresh
    tok = AutoTokenizer.from_pretrained(str(built[0]["general"]))
    streams = [tokenize_stream(tok, domain_text(d)) for d in DOMAINS]
    before = {n: p.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.router.requires_grad_(True)
    spec = GemRouterSpec(steps=15, learning_rate=0.05, batch_size=3, seq_len=24, seed=0)
    hist = train_router(model.model.router, gem_encoder(model), streams, spec, bos_id=tok.bos_token_id)
    assert hist["loss_curve"][-1][1] < hist["loss_curve"][0][1]
    for n, p in model.named_parameters():
        same = torch.equal(p, before[n])
        assert same != n.startswith("model.router."), n


def test_qat_trains_pathways_only_and_shrinks_the_penalty(fresh, built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moetool.methods.gem.qat import gem_plan, quant_bits, quant_penalty, run_qat
    from moetool.train.data import tokenize_stream

    model, r = fresh
    paths = built[0]
    tok = AutoTokenizer.from_pretrained(str(paths["general"]))
    streams = {d: tokenize_stream(tok, domain_text(d)) for d in DOMAINS}
    teachers = {d: AutoModelForCausalLM.from_pretrained(str(paths[d])).eval() for d in DOMAINS}
    bits = quant_bits(gem_plan(model, r.quantization, fit_rows=False))  # the nominal GEM role map
    assert {bits[n] for n in bits if ".pathways." in n} == {4}
    assert bits["model.router.weight"] == 6 and bits["model.layers.0.self_attn.q_proj.weight"] == 8
    assert "model.layers.0.mlp.pathways.0.input_layernorm.weight" not in bits  # 1-D tensors are never quantized
    # GGUF's row fit (rows of 32/48 here): q4_k → q5_0 and q6_k → q8_0, as llama.cpp would store them
    fitted = quant_bits(gem_plan(model, r.quantization))
    assert {fitted[n] for n in fitted if ".pathways." in n} == {5} and fitted["model.router.weight"] == 8
    spec = r.qat.model_copy(
        update={"steps": 6, "batch_size": 2, "seq_len": 24, "lambda_q": 10.0, "learning_rate": 1e-3}
    )
    before = {n: p.clone() for n, p in model.named_parameters()}
    path_params = {n: p for n, p in model.named_parameters() if ".pathways." in n}
    pen0 = float(quant_penalty(path_params, bits).detach())
    res = run_qat(model, teachers, streams, spec, bits, bos_id=tok.bos_token_id)
    assert res["trainable"] == ["pathways"] and all(row["kd"] >= 0 for row in res["curve"])
    assert float(quant_penalty(path_params, bits).detach()) < pen0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (".pathways." in n), n


def test_scar_model_is_causal_and_changes_attention(built):
    model = _load(built[2])
    assert model.config.scar_clusters == 3 and model.model.scar_centroids.abs().sum() > 0
    ids = torch.randint(4, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        prefix = model(ids[:, :25]).logits
        torch.testing.assert_close(prefix, full[:, :25], rtol=0, atol=1e-5)  # later tokens change nothing before
        model.config.scar_clusters = 0
        dense = model(ids).logits
    assert float((dense - full).abs().max()) > 1e-3


def test_gem_report_and_moetool_eval(built):
    import math

    from moetool.eval.report import evaluate
    from moetool.methods.gem.evaluate import gem_report

    paths, _, out = built
    texts = {d: domain_text(d, seed=7) for d in DOMAINS}
    rep = gem_report(out, paths["general"], {d: paths[d] for d in DOMAINS}, texts, seq_len=64, max_tokens=600)
    ppl = rep["perplexity"]
    # tau = 1 sends every token to general; with SCAR on it is not the general model, so compare SCAR-free below
    assert all(sh["general"] == 1.0 for sh in rep["routing"]["gem, all general (tau=1)"].values())
    assert all(sh["general"] == 0.0 for sh in rep["routing"]["gem, no fallback (tau=0)"].values())
    assert set(rep["experiment"]) == set(DOMAINS)
    for d, row in rep["experiment"].items():
        assert row["ppl_in_domain_expert"] == pytest.approx(ppl[f"expert {d}"][d], abs=1e-3)
        assert math.isfinite(row["gg_gem"]) and math.isfinite(row["gg_expert"])
    # moetool eval loads the GEM checkpoint through AutoModel (registered) and reports its GEM metrics
    ev = evaluate({"gem": out, "general": paths["general"]}, texts, seq_len=64, max_tokens=600)
    assert set(ev["gem"]) == {"gem", "general"} and ev["models"]["gem"]["moe"] is False
    assert ev["perplexity"]["gem"]["code"] == pytest.approx(ppl["gem (tau=0.7)"]["code"], rel=1e-6)


def test_onnx_graph_parity_with_threshold_and_scar_inside(built, tmp_path):
    from moetool.methods.gem.export import export_token_onnx

    m = export_token_onnx(built[2], tmp_path / "onnx")
    par = m["parity"]
    assert par["seq_lens"] == [32, 128]
    assert par["max_abs_logit_diff"] < 1e-4 and par["max_abs_prob_diff"] < 1e-5
    assert par["route_mismatches_off_boundary"] == 0
    assert m["scar_clusters"] == 3 and (tmp_path / "onnx" / "gem.onnx").is_file()
    assert not (tmp_path / "onnx" / "gem.onnx.data").exists()  # one self-contained file, no stale external data
    # the routes in the graph are not trivially all-general
    assert par["route_share"]["general"] < 1.0
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "onnx" / "gem.onnx")).graph.node}
    assert {"ArgMax", "Greater", "Where"} <= ops  # the rule and the cluster assignment are graph ops


def test_cli_dry_run_and_routing_log(built, tmp_path):
    from typer.testing import CliRunner

    from moetool.cli import app

    _, recipe, out = built
    runner = CliRunner()
    res = runner.invoke(app, ["merge", str(recipe), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "raspberry-pi-4: weights" in res.output and "tau 0.7" in res.output
    from moetool import api

    plan = api.plan(recipe)  # the same plan as data
    assert plan.method == "gem" and set(plan.inputs) == {"general", *(f"pathway {d}" for d in DOMAINS)}
    assert plan.render() in res.output.replace("\r", "")
    log = tmp_path / "routes.jsonl"
    res = runner.invoke(app, ["gem", "route", str(out), "--text", domain_text("legal")[:120], "--log", str(log)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows and all(r["route"] in ("general", *DOMAINS) for r in rows)
    for r in rows:  # every logged decision follows the rule
        best = max(r["probs"], key=r["probs"].get)
        assert r["route"] == (best if r["max_p"] > 0.7 else "general")


def test_graph_precisions_follow_the_gem_role_map(built):
    # the quantized export itself (MatMulNBits) is the ONNX exporter's quantize_graph; its figures on the zoo are in
    # docs/gem.md (a second trace here would double this file's run time)
    from moetool.errors import MoetoolError
    from moetool.methods.gem.export import GemGraph, graph_precisions

    graph = GemGraph(_load(built[2]))
    prec = graph_precisions(graph, "gem")
    assert {prec[n] for n in prec if ".pathways." in n} == {"int4"}  # GEM's role map: pathways 4-bit
    assert prec["router.weight"] == "int8" and prec["layers.0.mlp.gate_proj.weight"] == "int8"
    assert prec["layers.1.attn.q.weight"] == "int8" and prec["lm_head.weight"] == "int8"
    assert graph_precisions(graph, None) == {}
    with pytest.raises(MoetoolError, match="--quant 'f16'"):
        graph_precisions(graph, "f16")  # graph targets store f32, 8-bit or 4-bit weights


def test_tflite_graph_parity(built, tmp_path):
    from moetool.errors import MoetoolError
    from moetool.methods.gem.export import export_token_tflite

    try:
        from moetool.export.tflite.exporter import litert_python

        litert_python()
    except MoetoolError:
        pytest.skip("litert-torch is not installed (bash scripts/setup.sh --tflite)")
    m = export_token_tflite(built[2], tmp_path / "tfl")
    par = m["parity"]
    assert par["seq_lens"] == [32, 128] and par["max_abs_logit_diff"] < 1e-4 and par["max_abs_prob_diff"] < 1e-5
    assert par["route_mismatches_off_boundary"] == 0 and m["scar_clusters"] == 3
    assert (tmp_path / "tfl" / "gem.tflite").stat().st_size == m["bytes"]
