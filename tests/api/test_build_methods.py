"""``api.build`` on a method other than mofe: the stages the method has, in order; a stage it lacks is refused by
name before anything is written."""

from __future__ import annotations

import json

import pytest

from conftest import TEXT, save_dense
from methods.embedding.test_model import RECIPE  # the embedding tests' tiny recipe
from moetool.api import build
from moetool.errors import MoetoolError


@pytest.fixture()
def recipe(tmp_path):
    (tmp_path / "data.txt").write_text("\n\n".join([TEXT] * 6))
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(model=save_dense(tmp_path / "base")))
    return path


def test_build_runs_the_stages_the_method_has(recipe, tmp_path):
    stages = []
    res = build(recipe, tmp_path / "run", on_stage=lambda name, value: stages.append(name))
    assert stages == ["merged", "packaged"], "embedding: merge (its training is inside), then the repo folder"
    assert res.model == res.merged == tmp_path / "run" / "merged" and not res.tuned
    meta = json.loads((res.merged / "moetool.json").read_text())
    assert meta["embedding"]
    assert res.repo is not None and (res.repo / "README.md").is_file()
    assert {f.name for f in res.merged.glob("*.safetensors")} <= {f.name for f in res.repo.glob("*.safetensors")}


@pytest.mark.parametrize(
    ("kw", "named"),
    [({"tune": True}, "--train"), ({"presets": ["mofe"]}, "--presets"), ({"profiles": ["pi"]}, "profiles")],
)
def test_a_stage_the_method_lacks_is_refused_before_any_work(recipe, tmp_path, kw, named):
    with pytest.raises(MoetoolError, match=f"method embedding has no stage for {named}"):
        build(recipe, tmp_path / "run", **kw)
    assert not (tmp_path / "run").exists()
