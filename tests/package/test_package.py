"""``moetool package`` and ``moetool push``: the repo folder, its card, and an upload to a local fake Hub."""

from __future__ import annotations

import json
import shutil

import huggingface_hub.constants
import numpy as np
import pytest
import torch
import yaml
from fake_hub import FakeHub
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from conftest import TEXT, write_recipe
from moetool.api import assemble, export
from moetool.cli import app
from moetool.errors import OutputExistsError
from moetool.package import PackageError, PushError, build_repo, push, upload_files

TOKEN = "hf_fake_token_for_tests"
runner = CliRunner()


def _front_matter(readme):
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1]), text


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    """A run directory like out/demo: merged/, exports/q8/ (from merged), eval.json, plots/."""
    from moetool.eval.plots import write_plots
    from moetool.eval.report import evaluate

    m = tiny_models("llama")
    root = tmp_path_factory.mktemp("run")
    recipe = write_recipe(
        root / "r.yaml",
        f"""
name: tiny-moe
method: mofe
base_model: {m["base"]}
experts_per_token: 2
gate_mode: random
experts:
  - {{name: code, source: {m["e1"]}}}
  - {{name: legal, source: {m["e2"]}}}
""",
    )
    merged = assemble(recipe, root / "merged")
    export(merged, root / "exports" / "q8", target="gguf", quant="q8_0", verify=False)
    texts = {"code": TEXT, "legal": TEXT[::-1]}
    report = evaluate({"e1": m["e1"], str(merged): merged}, texts, seq_len=32, max_tokens=256)
    (root / "eval.json").write_text(json.dumps(report))
    write_plots(report, root / "plots")
    return root


@pytest.fixture(scope="module")
def packaged(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("pkg") / "repo"
    return build_repo(
        run / "merged", out, artifacts=[run / "exports" / "q8"], eval_json=run / "eval.json", plots=run / "plots"
    )


def test_folder_layout(run, packaged):
    names = {p.relative_to(packaged).as_posix() for p in packaged.rglob("*") if p.is_file()}
    gguf = json.loads((run / "exports" / "q8" / "manifest.json").read_text())["file"]
    pngs = {f"eval/plots/{p.name}" for p in (run / "plots").glob("*.png")}
    assert pngs
    assert (
        names
        == {
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "moetool.json",
            "moetool-recipe.yaml",
            f"gguf/q8/{gguf}",
            "gguf/q8/manifest.json",
            "eval/eval.json",
        }
        | pngs
    )
    assert (packaged / f"gguf/q8/{gguf}").read_bytes() == (run / "exports/q8" / gguf).read_bytes()


def test_card_front_matter_and_body(run, packaged):
    data, text = _front_matter(packaged / "README.md")
    assert "base_model" not in data and "base_model_relation" not in data  # all sources are local directories
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"moe", "moetool", "merge", "mofe", "mixtral", "gguf", "llama-cpp"} <= set(data["tags"])
    assert "license" not in data
    assert ModelCard.load(str(packaged / "README.md")).data.to_dict()["library_name"] == "transformers"
    meta = json.loads((packaged / "moetool.json").read_text())
    for src in meta["provenance"]["sources"].values():
        assert f"`{src['ref']}`" in text
        assert next(iter(src["files"].values())) in text  # weight hashes of every source
    assert "## On-device artifacts" in text and "`gguf/q8/" in text and "q8_0" in text
    assert "not verified (--no-verify)" in text
    assert "**" + str(run / "merged") + "** (this model)" in text  # the eval row of the packaged model
    assert "![perplexity](eval/plots/perplexity.png)" in text
    assert "```yaml\nname: tiny-moe" in text.replace("\n\n", "\n")
    assert "llama_cpp import Llama" in text


def test_card_reports_parity(run, tmp_path):
    art = shutil.copytree(run / "exports" / "q8", tmp_path / "verified")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["parity"] = {
        "runtime": "llama-cpp-python",
        "max_abs_logit_diff": {"64": 0.0123, "256": 0.0456},
        "top1_agreement": 0.9975,
        "ppl_reference": 10.0,
        "ppl_artifact": 10.05,
        "ppl_change": 0.005,
        "tokenizer_match": True,
    }
    (art / "manifest.json").write_text(json.dumps(manifest))
    text = (build_repo(run / "merged", tmp_path / "repo", artifacts=[art]) / "README.md").read_text()
    assert "max abs Δlogit 1.2e-02 @64, 4.6e-02 @256 tokens; top-1 agreement 99.75%; perplexity +0.50%" in text
    assert "tokenizer matches" in text and "`gguf/verified/" in text


def test_hub_sources_become_base_model(run, tmp_path):
    model = shutil.copytree(run / "merged", tmp_path / "model")
    meta = json.loads((model / "moetool.json").read_text())
    meta["provenance"]["sources"]["base"] |= {"ref": "some-org/tiny-base", "kind": "hf-cache", "revision": "a" * 40}
    (model / "moetool.json").write_text(json.dumps(meta))
    data, text = _front_matter(build_repo(model, tmp_path / "repo") / "README.md")
    assert data["base_model"] == ["some-org/tiny-base"] and data["base_model_relation"] == "merge"
    assert "gguf" not in data["tags"]
    assert "`local`: directories on the machine" in text


def test_packaged_model_gives_the_same_logits(run, packaged):
    ids = torch.tensor([[1, 5, 9, 42, 17, 3]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(run / "merged")).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(packaged)).eval()(ids).logits
    assert torch.equal(got, want)


def test_refuses_to_overwrite_without_force(run, packaged):
    before = (packaged / "README.md").read_text()
    with pytest.raises(OutputExistsError, match="--force"):
        build_repo(run / "merged", packaged)
    assert (packaged / "README.md").read_text() == before
    res = runner.invoke(app, ["package", str(run / "merged"), "-o", str(packaged)])
    assert res.exit_code == 2 and "--force" in res.output


def test_run_directory_defaults(run, tmp_path):
    res = runner.invoke(app, ["package", str(run), "-o", str(tmp_path / "repo")])
    assert res.exit_code == 0, res.output
    repo = tmp_path / "repo"
    assert (repo / "gguf/q8/manifest.json").is_file() and (repo / "eval/eval.json").is_file()
    assert (repo / "eval/plots/perplexity.png").is_file()
    assert json.loads((repo / "moetool.json").read_text())["name"] == "tiny-moe"
    assert "(this model)" in (repo / "README.md").read_text()


def test_run_directory_without_exports_prefers_tuned_mofe(run, tmp_path):
    shutil.copytree(run / "merged", tmp_path / "run" / "merged")
    tuned = shutil.copytree(run / "merged", tmp_path / "run" / "tuned-mofe")
    meta = json.loads((tuned / "moetool.json").read_text())
    (tuned / "moetool.json").write_text(json.dumps(meta | {"name": "tuned-one"}))
    repo = build_repo(tmp_path / "run", tmp_path / "repo")
    assert json.loads((repo / "moetool.json").read_text())["name"] == "tuned-one"
    assert not (repo / "gguf").exists() and not (repo / "eval").exists()


def test_artifacts_of_different_models_are_refused(run, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(run / "exports", root / "exports")
    shutil.copytree(run / "merged", root / "merged")
    other = shutil.copytree(run / "merged", root / "tuned-mofe")
    export(other, root / "exports" / "tuned-q8", target="gguf", quant="q8_0", verify=False)
    with pytest.raises(PackageError, match="different models"):
        build_repo(root, tmp_path / "repo")


def test_artifact_of_other_weights_is_refused(run, tmp_path):
    model = shutil.copytree(run / "merged", tmp_path / "changed")
    weights = load_file(str(model / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PackageError, match="other weights"):
        build_repo(model, tmp_path / "repo", artifacts=[run / "exports" / "q8"])
    assert not (tmp_path / "repo").exists()  # atomic: nothing half-written is left


def test_not_a_model_or_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackageError, match="neither a model directory"):
        build_repo(tmp_path / "empty", tmp_path / "repo")


def test_output_may_not_replace_the_source(run):
    before = sorted(p.name for p in (run / "merged").iterdir())
    # into the model, into an artifact, over the eval report: each input would gain or lose files
    for out in (run / "merged", run, run / "exports" / "q8", run / "merged" / "repo", run / "exports" / "q8" / "r"):
        with pytest.raises(PackageError, match="being packaged"):
            build_repo(run, out, force=True)
    with pytest.raises(PackageError, match="being packaged"):  # the run's eval.json, read into the card
        build_repo(run, run / "eval.json", force=True)
    assert (run / "eval.json").is_file()
    assert sorted(p.name for p in (run / "merged").iterdir()) == before


def test_packaged_gguf_runs_in_llama_cpp(packaged):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = next((packaged / "gguf" / "q8").glob("*.gguf"))
    llm = llama_cpp.Llama(model_path=str(path), verbose=False, logits_all=True, n_ctx=64)
    llm.eval([1, 5, 9, 42])
    logits = np.asarray(llm.scores[:4])
    assert logits.shape == (4, llm.n_vocab()) and np.isfinite(logits).all() and np.abs(logits).sum() > 0


# ---------------------------------------------------------------------------------------------------------- push


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake Hub, and no token but the test's own: no env var, no saved login of whoever runs the tests."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # a CI with HF_HUB_OFFLINE=1 still runs
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    with FakeHub(TOKEN) as h:
        yield h


def test_push_uploads_every_file(packaged, hub, capfd):
    sent = push(packaged, "tester/tiny-moe", endpoint=hub.url, token=TOKEN, private=True)
    local = {rel: (packaged / rel).read_bytes() for rel, _ in upload_files(packaged)}
    assert sorted(sent) == sorted(local)
    assert hub.files("tester/tiny-moe") == local  # every file arrived byte-identical
    assert hub.repos["tester/tiny-moe"].private
    assert hub.requests and all(r.authorization == f"Bearer {TOKEN}" for r in hub.requests)
    paths = [r.path for r in hub.requests]
    assert "/api/repos/create" in paths and "/api/models/tester/tiny-moe/commit/main" in paths
    captured = capfd.readouterr()
    assert TOKEN not in captured.out + captured.err


def test_push_to_a_branch(packaged, hub):
    push(packaged, "tester/tiny-moe", endpoint=hub.url, token=TOKEN, revision="dev", commit_message="first")
    assert set(hub.repos["tester/tiny-moe"].branches) == {"main", "dev"}
    assert "README.md" in hub.files("tester/tiny-moe", "dev") and not hub.files("tester/tiny-moe", "main")
    assert hub.repos["tester/tiny-moe"].commits == ["first"]


def test_push_cli_with_token_from_env(packaged, hub, monkeypatch, capfd):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    res = runner.invoke(app, ["push", str(packaged), "--repo-id", "tester/cli", "--endpoint", hub.url])
    assert res.exit_code == 0, res.output
    assert "pushed" in res.output and "tester/cli" in res.output
    assert "config.json" in hub.files("tester/cli")
    captured = capfd.readouterr()
    assert TOKEN not in res.output + captured.out + captured.err


def test_push_dry_run_sends_nothing(packaged, hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    res = runner.invoke(app, ["push", str(packaged), "--repo-id", "tester/dry", "--endpoint", hub.url, "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "README.md" in res.output and "gguf/q8/manifest.json" in res.output and "dry run" in res.output
    assert hub.requests == [] and hub.repos == {}
    assert TOKEN not in res.output


def test_push_errors_are_clear_and_hide_the_token(packaged, hub, capfd):
    wrong = "hf_wrong_token_never_shown"
    with pytest.raises(PushError, match="HTTP 401") as err:
        push(packaged, "tester/tiny-moe", endpoint=hub.url, token=wrong)
    assert wrong not in str(err.value) and TOKEN not in str(err.value)
    with pytest.raises(PushError, match="cannot reach"):
        push(packaged, "tester/tiny-moe", endpoint="http://127.0.0.1:9", token=wrong)
    res = runner.invoke(app, ["push", str(packaged), "--repo-id", "tester/x", "--endpoint", hub.url])
    assert res.exit_code == 2 and "no Hugging Face token" in res.output  # HF_TOKEN unset, no saved login used
    captured = capfd.readouterr()
    assert wrong not in captured.out + captured.err + res.output


def test_push_checks_the_folder_first(packaged, tmp_path, hub):
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(PushError, match="no README.md"):
        push(bare, "tester/x", endpoint=hub.url, token=TOKEN)
    (bare / "README.md").write_text("# no front matter\n")
    with pytest.raises(PushError, match="no YAML front matter"):
        push(bare, "tester/x", endpoint=hub.url, token=TOKEN)
    (bare / "README.md").write_text("---\nlicense: mit\n---\n# card\n")
    with pytest.raises(PushError, match="neither config.json nor an exported artifact"):
        push(bare, "tester/x", endpoint=hub.url, token=TOKEN)
    with pytest.raises(PushError, match="--repo-id"):
        push(packaged, "a/b/c", endpoint=hub.url, token=TOKEN)
    assert hub.requests == []


def test_task_scores_become_model_index(run, tmp_path):
    report = json.loads((run / "eval.json").read_text())
    merged = str(run / "merged")
    report["tasks"] = {
        merged: {"moetool_cont_code": {"acc": 0.61, "acc_stderr": 0.05, "acc_norm": 0.58, "n": 100.0}},
        "zoo:code": {"moetool_cont_code": {"acc": 0.55, "acc_stderr": 0.05, "n": 100.0}},
    }
    report["settings"]["tasks"] = {"names": ["moetool_cont_code"], "limit": 100, "num_fewshot": None}
    (tmp_path / "eval.json").write_text(json.dumps(report))
    readme = build_repo(run / "merged", tmp_path / "repo", eval_json=tmp_path / "eval.json") / "README.md"
    data, text = _front_matter(readme)
    (entry,) = data["model-index"]
    scores = {(r["dataset"]["name"], m["type"]): m["value"] for r in entry["results"] for m in r["metrics"]}
    assert scores == {("moetool_cont_code", "acc"): 0.61, ("moetool_cont_code", "acc_norm"): 0.58}
    card = ModelCard.load(str(readme))
    assert {(e.dataset_name, e.metric_type, e.metric_value) for e in card.data.eval_results} == {
        ("moetool_cont_code", "acc", 0.61),
        ("moetool_cont_code", "acc_norm", 0.58),
    }
    assert f"| **{merged}** (this model) | 0.610 ± 0.050 |" in text and "| zoo:code | 0.550 ± 0.050 |" in text
    assert "0-shot, first 100 documents" in text


def test_a_link_out_of_the_model_folder_is_refused(run, tmp_path):
    """A symlink in the model folder that points at a secrets file used to be copied into the repo as a plain file."""
    model = shutil.copytree(run / "merged", tmp_path / "linked")
    secret = tmp_path / "secrets.txt"
    secret.write_text("token=hf_xxx\n")
    (model / "generation_config.json").unlink(missing_ok=True)
    (model / "generation_config.json").symlink_to(secret)
    with pytest.raises(PackageError, match=r"generation_config.json is a link to .*secrets.txt, outside"):
        build_repo(model, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    # a link that stays inside the folder is fine
    (model / "generation_config.json").unlink()
    (model / "real.json").write_text("{}")
    (model / "generation_config.json").symlink_to(model / "real.json")
    build_repo(model, tmp_path / "repo2")


def test_card_lists_where_the_model_runs(run, packaged, tmp_path, tiny_models):
    """The consumer matrix: mlx-lm run on the folder (figures), llama.cpp by its converter's rule, vLLM by its
    source; a Qwen2-MoE asking for renormalised top-k says which consumers compute another function."""
    text = (packaged / "README.md").read_text()
    section = text.split("## Where it runs", 1)[1].split("\n## ", 1)[0]
    mlx = next(line for line in section.splitlines() if line.startswith("| mlx-lm"))
    assert "| ✓ |" in mlx and "max abs Δlogit" in mlx and "@32" in mlx
    assert "| llama.cpp | ✓ |" in section and "'llama'" in section and "| vLLM" in section

    m = tiny_models("qwen2")
    recipe = write_recipe(
        tmp_path / "q.yaml",
        f"name: q\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\ngate_mode: random\n"
        f"norm_topk_prob: true\nexperts:\n  - {{name: a, source: {m['e1']}}}\n  - {{name: b, source: {m['e2']}}}\n"
        f"  - {{name: c, source: {m['e3']}}}\n",
    )
    card = (build_repo(assemble(recipe, tmp_path / "q"), tmp_path / "repo") / "README.md").read_text()
    rows = card.split("## Where it runs", 1)[1].split("\n## ", 1)[0]
    assert "| llama.cpp | ✗ (its converter) |" in rows and "| mlx-lm (0.32.2) | ✗ |" in rows
