"""The method plugins: lazy assembler lookup, Auto-class registration, and `moetool export` naming the right command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moetool.export import ExportError


def test_cli_starts_without_loading_methods() -> None:
    code = "import sys, moetool.cli; print(any(m.startswith('moetool.methods.') for m in sys.modules), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"], "moetool --help must not import the method packages or torch"


def test_every_plugin_registers_its_assembler() -> None:
    from moetool.methods import PLUGINS, get_assembler

    for method in PLUGINS:
        assembler = get_assembler(method)
        assert assembler is not None and assembler.name == method
    assert get_assembler("mofe") is None  # a tensor-plan method


def test_models_module_registers_auto_classes() -> None:
    from transformers import AutoConfig

    import moetool.models  # noqa: F401

    for model_type in ("moetool_comigs", "moetool_gem", "moetool_routed_embedding"):
        assert AutoConfig.for_model(model_type).model_type == model_type


@pytest.mark.parametrize(
    ("files", "command"),
    [
        ({"config.json": {"model_type": "moetool_gem"}}, "moetool gem export"),
        ({"config.json": {"model_type": "moetool_routed_embedding"}}, "moetool embedding export"),
        ({"config.json": {"model_type": "moetool_comigs"}}, "moetool comigs bake"),
        ({"gem.json": {}}, "moetool gem export"),
    ],
)
def test_export_names_the_methods_exporter(tmp_path: Path, files: dict[str, dict], command: str) -> None:
    from moetool.api import plan_export

    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    with pytest.raises(ExportError, match=command):
        plan_export(tmp_path, tmp_path / "out", target="onnx")
