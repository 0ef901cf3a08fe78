"""Malformed files inside a model or artifact directory, through the commands that read them (issue 20).

Every JSON or YAML file of a model directory (``moetool.json``, ``moetool-recipe.yaml``, ``tokenizer.json``, a PEFT
``adapter_config.json``, an export's ``manifest.json``) is read strictly: exit code 2, one line naming the file (and
its line or key), no traceback, nothing written, no input changed. Also the documented commands that used to crash:
``moetool profile --gguf`` on a folder without a manifest, and ``-o NAME.gguf`` on ``moetool export``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


def _copy(env, name: str = "m") -> Path:
    model = env.root / "models" / name
    shutil.copytree(env.models["base"], model)
    return model


def test_inspect_refuses_duplicate_keys_in_moetool_json(env, refused):
    model = _copy(env)
    (model / "moetool.json").write_text('{"name": "a", "name": "b"}')
    refused(["inspect", str(model)], ["moetool.json", "'name' twice"], inputs=[model], sandbox=env.root)


def test_inspect_refuses_a_garbage_config_json(env, refused):
    model = _copy(env)
    (model / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    refused(["inspect", str(model)], ["config.json", "not UTF-8"], inputs=[model], sandbox=env.root)


# moetool-recipe.yaml is the recipe a model was merged from; export reads it (validated, as a recipe file is) for its
# quantization section
KEPT = "name: m\nmethod: mofe\nbase_model: zoo:base\ngate_mode: random\nexperts: [{name: a, source: zoo:code}]\n"
RECIPES = [
    ("syntax", "quantization: [\n", ["moetool-recipe.yaml:2:", "not valid YAML"]),
    (
        "duplicate-key",
        "quantization: {preset: q8_0}\nquantization: {preset: f16}\n",
        ["moetool-recipe.yaml:2:", "duplicate key 'quantization'"],
    ),
    (
        "bad-preset",
        KEPT + "quantization: {preset: q9_9}\n",
        ["moetool-recipe.yaml:6: quantization.preset:", "unknown preset 'q9_9'"],
    ),
    ("not-a-recipe", "quantization: {preset: q8_0}\n", ["moetool-recipe.yaml:1: method: None is not a known method"]),
    ("unknown-key", KEPT + "quantisation: {preset: q8_0}\n", ["moetool-recipe.yaml:6: quantisation: unknown key"]),
    ("not-a-mapping", "- quantization\n", ["moetool-recipe.yaml: a recipe must be a YAML mapping"]),
    ("latin-1", "name: caf\xe9\n".encode("latin-1"), ["moetool-recipe.yaml:1:", "not UTF-8"]),
]


@pytest.mark.parametrize(("text", "expected"), [(t, e) for _, t, e in RECIPES], ids=[i for i, _, _ in RECIPES])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "write"])
def test_export_refuses_a_malformed_model_recipe(env, refused, text, expected, dry_run):
    model = _copy(env)
    (model / "moetool-recipe.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    args = ["export", str(model), "-o", str(env.outs / "gguf"), *(["--dry-run"] if dry_run else [])]
    refused(args, expected, inputs=[model], sandbox=env.root)


def test_gguf_export_refuses_a_malformed_tokenizer_json(env, refused):
    model = _copy(env)
    (model / "tokenizer.json").write_text('{"model": {"type": "BPE"')
    args = ["export", str(model), "-o", str(env.outs / "gguf"), "--quant", "f32", "--no-verify"]
    refused(args, ["tokenizer.json:", "tokenizer is not valid JSON"], inputs=[model], sandbox=env.root)


def test_adapter_export_refuses_a_malformed_adapter_config(env, refused):
    adapter = env.root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "x",}')
    args = ["export", str(adapter), "-o", str(env.outs / "lora")]
    refused(
        args, ["adapter_config.json:1:", "PEFT adapter config is not valid JSON"], inputs=[adapter], sandbox=env.root
    )


@pytest.mark.parametrize("name", ["medical.gguf", "m.onnx", "m.TFLITE", "m.pte", "m.mlpackage"])
def test_export_output_named_like_an_artifact_is_refused(env, refused, name):
    model = env.models["base"]
    for extra in (["--dry-run"], []):
        refused(
            ["export", str(model), "-o", str(env.outs / name), *extra],
            [f"-o {env.outs / name}: -o takes a directory", f"-o {env.outs / Path(name).stem}"],
            inputs=[model],
            sandbox=env.root,
        )


def test_export_into_a_previous_export_named_like_an_artifact_is_allowed(env, cli):
    """A folder that already holds an export (its manifest.json) keeps working, whatever its name."""
    out = env.outs / "old.gguf"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    res = cli(["export", str(env.models["base"]), "-o", str(out), "--dry-run"])
    assert res.exit_code == 0, res.output


def test_hybrid_export_refuses_an_output_named_like_an_artifact(env, refused):
    out = env.outs / "router.onnx"
    refused(["hybrid", "export", str(env.models["base"]), "-o", str(out)], ["-o takes a directory"], inputs=[], sandbox=env.root)  # fmt: skip


def _fake_hybrid(path: Path) -> Path:
    """The two files ``moetool profile`` reads of a hybrid model: hybrid.json and the router's weights."""
    from safetensors.torch import save_file

    from moetool.methods.hybrid.router import HybridRouter

    path.mkdir(parents=True)
    save_file(HybridRouter(3, 4, 2).state_dict(), str(path / "router.safetensors"))
    # every field hybrid.json is checked for when it is read back (methods.hybrid.records.model_meta_from_json)
    experts = [
        {"name": n, "source": str(path / n), "path": str(path / n), "model_type": "llama", "kind": "transformer"}
        for n in ("small", "large")
    ]
    layout = {"length": False, "n_domains": 0, "hidden_dim": 0, "max_length": 64}
    router = {"in_features": 3, "hidden_size": 4, "utility_head": False, "layout": layout, "decision": "argmax",
              "granularity": "sequence", "encoder_layers": 0, "parameters": 26}  # fmt: skip
    meta = {
        "format": 1,
        "method": "hybrid",
        "name": "fake",
        "experts": experts,
        "tokenizer": {"vocab_size": 320},
        "router": router,
        "costly": "large",
    }
    (path / "hybrid.json").write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("kind", ["no-manifest", "no-folder", "other-manifest", "garbage-manifest"])
def test_profile_gguf_needs_a_hybrid_export_folder(env, refused, kind):
    model = _fake_hybrid(env.root / "hybrid")
    folder = env.root / "not-an-export"
    if kind != "no-folder":
        folder.mkdir()
    if kind == "other-manifest":
        (folder / "manifest.json").write_text('{"format": "moetool-gguf", "file": "model.gguf"}')
    if kind == "garbage-manifest":
        (folder / "manifest.json").write_text("{")
    expected = {
        "no-manifest": [
            f"{folder / 'manifest.json'}: missing",
            "`moetool export MODEL -o DIR` of a hybrid model writes it",
        ],
        "no-folder": [f"{folder}: no such directory", "`moetool export MODEL -o DIR` of a hybrid model writes it"],
        "other-manifest": ["manifest.json: format is 'moetool-gguf', not a hybrid export manifest"],
        "garbage-manifest": ["manifest.json:1:2: hybrid export manifest is not valid JSON"],
    }[kind]
    inputs = [model, *([folder] if folder.exists() else [])]
    refused(["profile", str(model), "--gguf", str(folder)], expected, inputs=inputs, sandbox=env.root)


def test_a_full_disk_mid_merge_is_a_named_error_that_leaves_nothing(env, cli, tools, monkeypatch):
    """ENOSPC while the merge streams its shards: one message naming the full disk, exit 2, no traceback, and
    neither the output nor its temporary folder left behind (what filled the disk is given back)."""
    import errno

    from moetool.io import writer

    real_add = writer.ShardedWriter.add
    calls = {"n": 0}

    def add(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(self, name, tensor)

    monkeypatch.setattr(writer.ShardedWriter, "add", add)
    recipe = env.recipe(
        f"name: full\nmethod: mofe\nbase_model: {env.models['base']}\ngate_mode: random\nexperts_per_token: 1\n"
        f"experts:\n  - {{name: a, source: {env.models['e1']}}}\n  - {{name: b, source: {env.models['e2']}}}\n"
    )
    res = cli(["merge", str(recipe), "-o", str(env.outs / "moe")])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "the disk filled up while writing" in text and "Traceback" not in res.output
    assert list(env.outs.iterdir()) == [] and not tools.leftovers(env.outs)
