"""An MLX export folder given back to moetool: every export refuses it as a source, naming the folder to give
instead, and ``moetool inspect`` reads it as the model it holds (packed words unpacked, stacked experts as experts)."""

from __future__ import annotations

from pathlib import Path

import pytest
from consumer_fixtures import merge

from conftest import save_dense
from moetool.api import export, plan_export
from moetool.errors import MoetoolError
from moetool.inspect import inspect_model

WIDE = {"hidden_size": 64, "intermediate_size": 128}  # rows a group of 64 divides, so every matrix quantizes


@pytest.fixture(scope="module")
def mlx_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A tiny Mixtral and its MLX exports at moe-q4 (4-bit experts, 8-bit rest, router float) and f32."""
    tmp = tmp_path_factory.mktemp("mlx-folders")
    base = save_dense(tmp / "base", "llama", **WIDE)
    m = {"base": base} | {
        f"e{i}": save_dense(tmp / f"e{i}", "llama", seed=i, base=base, mlp_noise=0.3) for i in (1, 2, 3)
    }
    moe = merge(tmp, m, "mixtral")
    outs = {q: tmp / f"mlx-{q}" for q in ("moe-q4", "f32")}
    for q, out in outs.items():
        export(moe, out, target="mlx", quant=q, verify=False)
    return moe, outs


@pytest.mark.parametrize("target", ["mlx", "gguf", "onnx"])
def test_every_target_refuses_an_mlx_export_as_its_source(target, mlx_folders, tmp_path):
    moe, outs = mlx_folders
    for quant, folder in outs.items():
        with pytest.raises(MoetoolError, match=r"is an MLX export .*merged Hugging Face model folder") as err:
            plan_export(folder, tmp_path / "out", target=target)
        assert str(moe) in str(err.value)  # the folder it was made from, read from its manifest
        assert ("quantized packed weights" in str(err.value)) == (quant == "moe-q4")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quant", ["moe-q4", "f32"])
def test_inspect_reads_an_mlx_export_as_the_model_it_holds(quant, mlx_folders):
    moe, outs = mlx_folders
    source, folder = inspect_model(moe), inspect_model(outs[quant])
    for key in ("total_params", "active_params_per_token", "router_shapes", "num_experts", "experts_per_token"):
        assert folder[key] == source[key], key
    assert source["total_params"] > folder["active_params_per_token"]  # one idle expert of 3 per layer
    assert str(folder["layout"]).startswith("mlx-lm") and source["layout"] == "Hugging Face"


def test_inspect_refuses_packed_weights_whose_bits_the_config_does_not_give(mlx_folders, tmp_path):
    """A packed folder whose config.json lost its quantization section: a named error (exit 2), no traceback."""
    import json
    import shutil

    from typer.testing import CliRunner

    from moetool.cli import app

    _, outs = mlx_folders
    folder = shutil.copytree(outs["moe-q4"], tmp_path / "mlx")
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization")
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    r = CliRunner().invoke(app, ["inspect", str(folder), "--json"])
    assert r.exit_code == 2, r.output
    assert "is packed (uint32 words), but config.json's 'quantization' gives no bits for" in r.output
