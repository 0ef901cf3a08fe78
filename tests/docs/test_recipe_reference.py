"""docs/reference/recipe.md is the recipe schema as it is now (scripts/gen_recipe_reference.py writes it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_recipe_reference.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_recipe_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_the_schema_rendered() -> None:
    gen = generator()
    assert gen.PAGE.read_text(encoding="utf-8") == gen.render(), (
        "docs/reference/recipe.md is stale (a recipe model changed): run .venv/bin/python scripts/gen_recipe_reference.py"
    )


def test_every_method_and_every_section_model_has_a_section() -> None:
    from moetool.recipe import recipe_json_schema

    text = generator().render()
    for name in recipe_json_schema()["$defs"]:
        assert f"\n### {name}\n" in text, name
    for link in ("#moferecipe", "#trainspec", "#quantspec", "#targetspec"):
        assert f"]({link})" in text


def test_check_mode_names_the_stale_page(tmp_path: Path) -> None:
    gen = generator()
    gen.PAGE = tmp_path / "recipe.md"
    gen.PAGE.write_text("# an old page\n", encoding="utf-8")
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0


def test_the_script_runs_from_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], check=False, capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
