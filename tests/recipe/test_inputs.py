"""recipe_inputs: what an output may not be, sit inside, or contain."""

from __future__ import annotations

from conftest import write_recipe
from moetool.recipe import load_recipe
from moetool.recipe.inputs import recipe_inputs


def test_models_and_the_recipe_are_inputs_prompts_are_not(tiny_models, tmp_path, monkeypatch):
    m = tiny_models("llama")
    (tmp_path / "out").mkdir()  # a folder whose name is also a prompt
    monkeypatch.chdir(tmp_path)
    r = write_recipe(
        tmp_path / "r.yaml",
        f"""name: t
method: mofe
base_model: {m["base"]}
gate_mode: hidden
experts:
  - {{name: a, source: {m["e1"]}, positive_prompts: ["out"]}}
  - {{name: b, source: {m["e2"]}, positive_prompts: ["def main(): pass"]}}
""",
    )
    found = {p.resolve() for p in recipe_inputs(load_recipe(r))}
    assert {r.resolve(), m["base"].resolve(), m["e1"].resolve(), m["e2"].resolve()} <= found
    assert (tmp_path / "out").resolve() not in found
