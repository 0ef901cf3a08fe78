"""Size limits of the source tree (docs/architecture.md): no module over 400 lines, no function over 80."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moetool"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_module_over_the_limit() -> None:
    too_long = {
        str(p.relative_to(SRC)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): {too_long}"


def test_no_function_over_the_limit() -> None:
    too_long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long[f"{p.relative_to(SRC)}:{node.name}"] = n
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {too_long}"


def test_the_layout_checks_see_the_tree() -> None:
    assert len(_modules()) > 100 and (SRC / "registry.py").is_file()
