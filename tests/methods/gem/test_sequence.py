"""Sequence-level GEM: whole expert models as pathways, a pooled router, the bundle, its export (router.onnx + one
GGUF artifact per pathway + manifest) and the reference dispatcher against the PyTorch router."""

from __future__ import annotations

import json

import pytest
import torch
from gem_fixtures import domain_text, make_gem_inputs, recipe_text

DOMAINS = ("code", "medical")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from moetool.api import assemble

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gemseq")
    paths = make_gem_inputs(root, DOMAINS)
    recipe = root / "gem.yaml"
    recipe.write_text(recipe_text(paths, DOMAINS, level="sequence").replace("tau: 0.7", "tau: 0.6"))
    return paths, assemble(recipe, root / "bundle")


def test_bundle_layout_and_router(bundle):
    from moetool.io.checkpoint import Checkpoint
    from moetool.methods.gem.evaluate import SequenceGem

    paths, out = bundle
    spec = json.loads((out / "gem.json").read_text())
    assert spec["domains"] == list(DOMAINS) and spec["encoder"]["pool"] == "mean"
    for name in ("general", *DOMAINS):  # pathways are the source models, unchanged
        a, b = Checkpoint(out / "pathways" / name), Checkpoint(paths[name])
        assert all(torch.equal(a.get(n), b.get(n)) for n in b.tensors)
    rep = json.loads((out / "gem-report.json").read_text())
    assert rep["router"]["argmax_accuracy"] >= 0.75  # two domains: chance is 0.5
    seq = SequenceGem(out)
    for d in DOMAINS:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(out))(domain_text(d, seed=3)[:300], return_tensors="pt").input_ids
        probs, route = seq.route(ids)
        assert seq.names[int(route)] in (d, "general") and probs.shape == (1, 2)
        # the chosen pathway's logits are exactly that model's
        got = seq(ids).logits
        torch.testing.assert_close(got, seq.pathways[int(route)](ids).logits, rtol=0, atol=0)


def test_export_and_dispatcher_follow_the_router(bundle, tmp_path):
    from moetool.methods.gem.dispatch import GemDispatcher
    from moetool.methods.gem.evaluate import SequenceGem
    from moetool.methods.gem.export import export_sequence_bundle

    _, out = bundle
    m = export_sequence_bundle(out, tmp_path / "exp", target="gguf", quant="f32")  # llama.cpp runs the pathways
    par = m["router"]["parity"]
    assert par["seq_lens"] == [32, 128] and par["same_route"] == par["windows"] and par["max_abs_prob_diff"] < 1e-5
    # the probes cover every domain's held-out text (local text files here), one window per length each
    assert par["windows"] == 2 * len(DOMAINS)
    assert set(m["pathways"]) == {"general", *DOMAINS}
    for entry in m["pathways"].values():  # each pathway went through the GGUF exporter and its llama.cpp parity gate
        assert (tmp_path / "exp" / entry["file"]).is_file()
        assert max(entry["parity"]["max_abs_logit_diff"].values()) < 1e-4
    disp = GemDispatcher(tmp_path / "exp")
    seq = SequenceGem(out)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    # the dispatcher's ids are what router training saw: BOS, then the text without special tokens
    assert disp.ids("def f(): pass") == [tok.bos_token_id, *tok("def f(): pass", add_special_tokens=False).input_ids]
    seen = set()
    for d in DOMAINS:
        for seed in range(3):
            text = domain_text(d, seed=seed)[:200]
            dec = disp.dispatch(text)
            probs, route = seq.route(torch.tensor([disp.ids(text)]))
            assert dec.pathway == seq.names[int(route)]
            assert max(abs(dec.probs[n] - float(p)) for n, p in zip(DOMAINS, probs[0], strict=True)) < 1e-5
            assert dec.artifact.is_file() and dec.manifest["target"] == "gguf"
            seen.add(dec.pathway)
    assert seen & set(DOMAINS)  # the dispatcher does route to domain pathways


def test_sequence_level_rejects_scar_and_qat(tmp_path):
    from moetool.errors import RecipeError
    from moetool.recipe.load import parse_recipe

    text = (
        "name: s\nmethod: gem\ngeneral: zoo:base\nlevel: sequence\ndomains:\n  - name: code\n    source: zoo:code\n"
        "    data: {zoo: code}\nqat:\n  steps: 5\n"
    )
    with pytest.raises(RecipeError, match="qat.steps: QAT tunes the token-level"):
        parse_recipe(text, tmp_path / "s.yaml")


def test_sequence_gem_report(bundle):
    from moetool.methods.gem.evaluate import gem_report

    paths, out = bundle
    assert (out / "moetool-recipe.yaml").is_file()  # `moetool gem eval` reads the domains' text from it
    texts = {d: domain_text(d, seed=5) for d in DOMAINS}
    rep = gem_report(out, paths["general"], {d: paths[d] for d in DOMAINS}, texts, seq_len=64, max_tokens=300)
    ppl = rep["perplexity"]
    assert rep["settings"]["level"] == "sequence"
    # tau = 1 routes every window to the general pathway: exactly the general model's perplexity
    assert ppl["gem, all general (tau=1)"] == pytest.approx(ppl["general"], rel=1e-9)
    assert all(sh["general"] == 0.0 for sh in rep["routing"]["gem, no fallback (tau=0)"].values())
    assert set(rep["experiment"]) == set(DOMAINS)
