"""``api.build`` of a method's recipe with ``targets:``: each method is built with the targets its plan accepts (GEM
token level: onnx, tflite; GEM sequence level and hybrid, bundles: gguf, onnx and every graph target, their members
through the standard exporters as for any target; embedding: onnx, coreml, tflite; tflite where litert-torch is set up), each export
written through the manifest contract of the standard exports and packaged, by the build and again by ``moetool
package`` on the run folder. A target the method cannot write, a key its exporter would not read, or an evaluation
option its build has no stage for is refused at plan time: nothing merged, no output folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gem_fixtures import make_gem_inputs, recipe_text
from hybrid_tiny_models import save_pair, write_texts
from typer.testing import CliRunner

from conftest import TEXT, save_dense
from methods.embedding.test_model import RECIPE as EMBEDDING_RECIPE
from methods.hybrid.test_e2e import RECIPE as HYBRID_RECIPE
from moetool import api
from moetool.errors import MoetoolError, RecipeError
from moetool.export.base import read_manifest

torch.set_num_threads(1)  # the CPU is shared; tiny models gain nothing from more threads


def _targets(*entries: str) -> str:
    return "targets:\n" + "".join(f"  - {e}\n" for e in entries)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny inputs of every method: a GEM general model with one domain expert, a llama and a Mamba for hybrid, a
    dense model and its text for the routed embedding."""
    root = tmp_path_factory.mktemp("build-targets")
    paths = make_gem_inputs(root / "gem", ("code",))
    llama, mamba = save_pair(root / "hybrid")
    texts = write_texts(root / "hybrid")
    (root / "emb").mkdir()
    (root / "emb" / "data.txt").write_text("\n\n".join([TEXT] * 6))
    dense = save_dense(root / "emb" / "base")
    return paths | {"llama": llama, "mamba": mamba, "root": root, "dense": dense} | texts


def gem_recipe(inputs: dict[str, Path], path: Path, level: str, *targets: str) -> Path:
    path.write_text(recipe_text(inputs, ("code",), level=level) + (_targets(*targets) if targets else ""))
    return path


def hybrid_recipe(inputs: dict[str, Path], path: Path, *targets: str) -> Path:
    text = HYBRID_RECIPE.format(
        llama=inputs["llama"], mamba=inputs["mamba"], alpha=inputs["alpha"], beta=inputs["beta"]
    )
    path.write_text(text + (_targets(*targets) if targets else ""))
    return path


def embedding_recipe(inputs: dict[str, Path], path: Path, *targets: str) -> Path:
    text = EMBEDDING_RECIPE.format(model=inputs["dense"]).replace("data.txt", str(inputs["root"] / "emb" / "data.txt"))
    path.write_text(text + (_targets(*targets) if targets else ""))
    return path


@pytest.fixture()
def no_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before the merge: the build's assemble stage fails the test if it is reached."""
    from moetool.api import pipeline

    def merged(*args: object, **kw: object) -> None:
        raise AssertionError("the build merged before refusing")

    monkeypatch.setattr(pipeline, "assemble", merged)


@pytest.mark.parametrize(
    ("method", "level", "entry", "message"),
    [
        ("gem", "token", "{target: gguf}",
         r"targets\.0\.target: method gem \(level: token\) cannot write target 'gguf'; the targets it writes: onnx, "
         r"tflite"),
        ("gem", "token", "{target: coreml}", r"method gem \(level: token\) cannot write target 'coreml'"),
        ("gem", "token", "{target: tflite, quant: q8_0}",
         r"targets\.0\.quant: method gem's tflite export does not read quant \(this export is written in float32"),
        ("gem", "token", "{for: raspberry-pi-4}",
         r"targets\.0\.for: method gem's outputs export by target, not for a deployment profile .*onnx, tflite"),
        ("gem", "sequence", "{target: gguf, for: raspberry-pi-4}",
         r"targets\.0\.for: method gem's gguf export does not read for"),
        ("gem", "sequence", "{target: gguf, imatrix: auto}", r"targets\.0\.imatrix: method gem's gguf export"),
        ("gem", "sequence", "{target: onnx, context: 64}", r"targets\.0\.context: method gem's onnx export"),
        ("embedding", None, "{target: gguf}",
         r"targets\.0\.target: method embedding cannot write target 'gguf'; the targets it writes: onnx, tflite, "
         r"coreml"),
        ("embedding", None, "{target: onnx, quant: q8_0}", r"targets\.0\.quant: method embedding's onnx export"),
        ("hybrid", None, "{target: onnx, context: 64}", r"targets\.0\.context: method hybrid's onnx export"),
    ],
)  # fmt: skip
def test_a_target_the_method_cannot_write_is_refused_before_any_work(
    inputs, tmp_path, no_merge, method, level, entry, message
):
    if method == "gem":
        recipe = gem_recipe(inputs, tmp_path / "r.yaml", level, entry)
    elif method == "hybrid":
        recipe = hybrid_recipe(inputs, tmp_path / "r.yaml", entry)
    else:
        recipe = embedding_recipe(inputs, tmp_path / "r.yaml", entry)
    with pytest.raises(RecipeError, match=message):
        api.build(recipe, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    with pytest.raises(RecipeError, match=message):  # `moetool validate` says the same
        api.check(recipe)


def test_the_cli_refuses_a_gem_gguf_target_with_exit_2_and_writes_nothing(inputs, tmp_path, no_merge):
    from moetool.cli import app

    recipe = gem_recipe(inputs, tmp_path / "r.yaml", "token", "{target: gguf}")
    r = CliRunner().invoke(app, ["build", str(recipe), "-o", str(tmp_path / "run")])
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "method gem (level: token) cannot write target 'gguf'; the targets it writes: onnx, tflite" in text
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("args", "named"), [(["--max-tokens", "100"], "--max-tokens"), (["--task-limit", "5"], "--task-limit")]
)
def test_gem_build_refuses_evaluation_options_it_has_no_stage_for(inputs, tmp_path, no_merge, args, named):
    """GEM's build has no evaluation stage: its options are refused like --tasks, not ignored."""
    from moetool.cli import app

    recipe = gem_recipe(inputs, tmp_path / "r.yaml", "token", "{target: onnx}")
    r = CliRunner().invoke(app, ["build", str(recipe), "-o", str(tmp_path / "run"), *args])
    assert r.exit_code == 2, r.output
    assert f"method gem has no stage for {named}" in " ".join(r.output.split())
    assert not (tmp_path / "run").exists()
    with pytest.raises(MoetoolError, match=f"method gem has no stage for {named}"):
        api.build(
            recipe,
            tmp_path / "run",
            max_tokens=100 if named == "--max-tokens" else None,
            task_limit=5 if named == "--task-limit" else None,
        )


def test_two_targets_into_one_folder_are_refused_when_the_recipe_is_read(inputs, tmp_path):
    recipe = gem_recipe(inputs, tmp_path / "r.yaml", "token", "{target: onnx}", "{target: onnx, quant: gem}")
    with pytest.raises(RecipeError, match=r"r\.yaml:\d+: targets\.1: a second target named 'onnx'"):
        api.load(recipe)


def has_litert() -> bool:
    """Whether the TFLite targets can run here (litert-torch lives in its own venv: ``setup.sh --tflite``)."""
    from moetool.export.tflite.runner import litert_python

    try:
        litert_python()
    except MoetoolError:
        return False
    return True


def check_packaged(run: Path, repo: Path, names: list[str]) -> None:
    """Every export of the run is in the repo folder, file for file as its manifest lists them, beside the model."""
    for name in names:
        m = read_manifest(run / "exports" / name)
        assert m.target and m.file and isinstance(m["model"]["weights_sha256"], dict) and m["model"]["weights_sha256"]
        assert m.verified, f"{name}: {m.parity}"
        for rel in m["files"]:
            assert (repo / m.target / name / rel).is_file(), f"{name}: {rel} not packaged"
        assert json.loads((repo / m.target / name / "manifest.json").read_text()) == m
    assert (repo / "moetool.json").is_file() and "## On-device artifacts" in (repo / "README.md").read_text()


def build_and_package(recipe: Path, tmp_path: Path, names: list[str]) -> tuple[Path, Path]:
    """``api.build`` (which packages its run), then ``moetool package`` on the run folder; returns both repos."""
    from moetool.cli import app

    res = api.build(recipe, tmp_path / "run")
    assert res.repo == tmp_path / "run" / "hf-repo" and sorted(res.manifests) == sorted(names)
    check_packaged(tmp_path / "run", res.repo, names)
    r = CliRunner().invoke(app, ["package", str(tmp_path / "run"), "-o", str(tmp_path / "repo")])
    assert r.exit_code == 0, r.output
    check_packaged(tmp_path / "run", tmp_path / "repo", names)
    return res.repo, tmp_path / "repo"


@pytest.mark.slow
def test_gem_token_level_builds_and_packages_onnx_and_tflite(inputs, tmp_path):
    names = ["onnx", "tflite"] if has_litert() else ["onnx"]
    recipe = gem_recipe(inputs, tmp_path / "r.yaml", "token", *(f"{{target: {n}}}" for n in names))
    _, repo = build_and_package(recipe, tmp_path, names)
    assert (repo / "onnx" / "onnx" / "gem.onnx").is_file() and (repo / "model.safetensors").is_file()
    assert read_manifest(repo / "onnx" / "onnx")["parity"]["max_abs_logit_diff"] < 1e-4


@pytest.mark.slow
def test_gem_sequence_level_builds_and_packages_a_bundle(inputs, tmp_path):
    """The bundle (gem.json, router, whole pathway models) is packaged whole, its export beside it."""
    recipe = gem_recipe(inputs, tmp_path / "r.yaml", "sequence", "{target: gguf, quant: f32}", "{target: onnx}")
    built, repo = build_and_package(recipe, tmp_path, ["gguf", "onnx"])
    for r in (built, repo):
        assert (r / "gem.json").is_file() and (r / "pathways" / "code" / "model.safetensors").is_file()
        assert (r / "gguf" / "gguf" / "pathways" / "general").is_dir()
    m = read_manifest(repo / "gguf" / "gguf")
    assert m.file == "router.onnx" and set(m["parity"]["members"]) == {"general", "code"}
    assert "pathways/code/model.safetensors" in m["model"]["weights_sha256"]


@pytest.mark.slow
def test_hybrid_builds_and_packages_gguf_and_onnx(inputs, tmp_path):
    """The Mamba expert has no ONNX form: its refusal is recorded in the bundle, the rest ships and packages."""
    recipe = hybrid_recipe(inputs, tmp_path / "r.yaml", "{target: gguf, quant: f32}", "{target: onnx}")
    _, repo = build_and_package(recipe, tmp_path, ["gguf", "onnx"])
    assert (repo / "hybrid.json").is_file() and (repo / "router.safetensors").is_file()
    gg = read_manifest(repo / "gguf" / "gguf")
    assert all((repo / "gguf" / "gguf" / e["dir"] / e["file"]).is_file() for e in gg["experts"])
    assert [e["file"].endswith(".gguf") for e in gg["experts"]] == [True, True]  # the Mamba's by its own writer
    members = read_manifest(repo / "onnx" / "onnx")["parity"]["members"]
    assert isinstance(members["llama"], dict) and "max_abs_logit_diff" in members["llama"]


@pytest.mark.slow
def test_embedding_builds_and_packages_every_graph_target(inputs, tmp_path):
    """onnx (two graphs), coreml (a package folder: its Manifest.json stands for it in the hashes) and tflite."""
    names = ["onnx", "coreml", "tflite"] if has_litert() else ["onnx", "coreml"]
    recipe = embedding_recipe(inputs, tmp_path / "r.yaml", *(f"{{target: {n}}}" for n in names))
    _, repo = build_and_package(recipe, tmp_path, names)
    for graph in ("model.onnx", "model-with-past.onnx"):
        assert (repo / "onnx" / "onnx" / graph).is_file()
    assert (repo / "coreml" / "coreml" / "model.mlpackage" / "Manifest.json").is_file()


# Every pair passed here on 2026-11-28; the ExecuTorch ones and GEM's TFLite one take 2-5 minutes each, so CI keeps
# the others (the members go through the same standard exporters whatever the method)
BUNDLE_CASES = [("gem", "coreml"), ("hybrid", "tflite"), ("hybrid", "coreml")]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "target"), BUNDLE_CASES)
def test_bundles_build_and_package_on_every_graph_target(inputs, tmp_path, method, target):
    """A bundle's members go through the standard exporter of the target: the router graph (ONNX) beside members in
    the target's own format, each verified in its runtime (a member the target cannot hold, such as hybrid's Mamba,
    recorded as refused), packaged whole."""
    if target == "tflite" and not has_litert():
        pytest.skip("litert-torch is not set up (bash scripts/setup.sh --tflite)")
    entry = f"{{target: {target}}}"
    if method == "gem":
        recipe = gem_recipe(inputs, tmp_path / "r.yaml", "sequence", entry)
    else:
        recipe = hybrid_recipe(inputs, tmp_path / "r.yaml", entry)
    _, repo = build_and_package(recipe, tmp_path, [target])
    members = read_manifest(repo / target / target)["parity"]["members"]
    verified = [m for m in members.values() if isinstance(m, dict) and "max_abs_logit_diff" in m]
    assert verified, members
