"""Option values, report paths and files of ``experts``, ``export`` and ``train`` held to the merge's contract.

Every refusal runs ``moetool …`` in-process through :func:`conftest.run_refused`: exit code 2, the message naming the
problem, no traceback, nothing written, every input byte-identical. The cases are the ones a held-out corpus found
(issue 39): NaN and infinite counts, reports written over inputs, options accepted and never read, files parsed
without a named error, a LoRA adapter of another width, a model of another architecture than the recipe's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import TEXT, save_dense, write_recipe
from moetool import api

TOO_SHORT = "def f(x): return x\n"  # a few tokens: an importance matrix of almost nothing


@pytest.fixture(scope="module")
def built(tiny_models, tmp_path_factory) -> Path:
    m = tiny_models("llama")
    tmp = tmp_path_factory.mktemp("options-moe")
    experts = "".join(f"  - {{name: x{i}, source: {m[f'e{i}']}, positive_prompts: ['p{i} def']}}\n" for i in (1, 2, 3))
    text = f"name: moe\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\nexperts:\n{experts}"
    return api.assemble(write_recipe(tmp / "moe.yaml", text), tmp / "moe")


@pytest.fixture
def moe(env, built) -> Path:
    """A private copy of the MoE inside the sandbox, so that every change to it is seen."""
    given = env.root / "models" / "moe"
    shutil.copytree(built, given)
    return given


@pytest.fixture
def texts(env) -> dict[str, Path]:
    out = {"good": env.work / "calib.txt", "blank": env.work / "blank.txt", "short": env.work / "short.txt"}
    out["good"].write_text(TEXT * 4, encoding="utf-8")
    out["blank"].write_text("  \n\t\n   \n", encoding="utf-8")
    out["short"].write_text(TOO_SHORT, encoding="utf-8")
    return out


def _experts_cases(moe: Path, env, t: dict[str, Path]) -> dict[str, tuple[list[str], list[str]]]:
    out = str(env.outs / "edited")
    data = ["--data", f"calib={t['good']}"]
    prune = ["experts", "prune", str(moe), "-o", out, *data]
    to = ["-o", out]
    return {
        "keep-nan": ([*prune, "--keep", "nan"], ["--keep nan", "a fraction between 0 and 1"]),
        "keep-inf": ([*prune, "--keep", "inf"], ["--keep inf"]),
        "keep-negative": ([*prune, "--keep", "-2"], ["--keep -2.0"]),
        "keep-zero": ([*prune, "--keep", "0"], ["--keep 0.0"]),
        "prune-into-the-moe": (
            ["experts", "prune", str(moe), "-o", str(moe / "pruned"), *data, "--keep", "2"],
            ["overlaps the input"],
        ),
        "list-json-directory": (["experts", "list", str(moe), "-o", str(env.outs)], ["--output", "is a directory"]),
        "list-json-over-config": (
            ["experts", "list", str(moe), "-o", str(moe / "config.json")],
            ["--output", "is inside the input"],
        ),
        "list-json-over-data": (
            ["experts", "list", str(moe), *data, "-o", str(t["good"])],
            ["--output", "is an input"],
        ),
        "list-dtype-without-data": (
            ["experts", "list", str(moe), "--dtype", "float16"],
            ["--dtype float16", "list runs the model only to score --data"],
        ),
        "list-device-unknown": (["experts", "list", str(moe), *data, "--device", "mps"], ["--device 'mps'"]),
        "remove-dtype-unknown": (["experts", "remove", str(moe), "x1", "-o", out, "--dtype", "bf"], ["--dtype 'bf'"]),
        "remove-device-unknown": (
            ["experts", "remove", str(moe), "x1", "-o", out, "--device", "mps"],
            ["--device 'mps'", "choose auto, cpu, cuda or cuda:N"],
        ),
        "remove-dtype-unread": (
            ["experts", "remove", str(moe), "x1", "-o", out, "--dtype", "bfloat16"],
            ["--dtype bfloat16", "without --tune-steps"],
        ),
        "remove-data-unread": (
            ["experts", "remove", str(moe), "x1", "-o", out, *data],
            ["--data", "give --tune-steps N"],
        ),
        "remove-over-data": (
            ["experts", "remove", str(moe), "x1", "-o", str(t["good"]), "--force", "--tune-steps", "1", *data],
            ["overlaps the input", str(t["good"])],
        ),
        "remove-router-lr-zero": (
            ["experts", "remove", str(moe), "x1", "-o", out, "--tune-steps", "1", "--router-lr", "0", *data],
            ["--router-lr 0.0", "above 0"],
        ),
        "add-data-unread": (
            [
                "experts",
                "add",
                str(moe),
                "--source",
                str(env.models["e1"]),
                "--name",
                "n",
                "--prompt",
                "def",
                *to,
                *data,
            ],
            ["--data", "give --tune-steps N"],
        ),
    }


CASES = [  # the keys of _experts_cases (its paths need the fixtures)
    "keep-nan",
    "keep-inf",
    "keep-negative",
    "keep-zero",
    "prune-into-the-moe",
    "list-json-directory",
    "list-json-over-config",
    "list-json-over-data",
    "list-dtype-without-data",
    "list-device-unknown",
    "remove-dtype-unknown",
    "remove-device-unknown",
    "remove-dtype-unread",
    "remove-data-unread",
    "remove-over-data",
    "remove-router-lr-zero",
    "add-data-unread",
]


@pytest.mark.parametrize("case", CASES)
def test_experts_option(env, refused, moe, texts, case):
    args, expected = _experts_cases(moe, env, texts)[case]
    refused(args, expected, inputs=[moe, *env.models.values(), *texts.values()], sandbox=env.root)


@pytest.mark.parametrize("edits", ["a summary", {"op": "remove"}, ["a summary"], [None]])
@pytest.mark.parametrize("command", ["list", "remove"])
def test_malformed_edits_in_moetool_json(env, refused, moe, command, edits):
    meta = moe / "moetool.json"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"edits": edits}))
    args = {
        "list": ["experts", "list", str(moe)],
        "remove": ["experts", "remove", str(moe), "x1", "-o", str(env.outs / "edited")],
    }[command]
    refused(args, [str(meta), "edits"], inputs=[moe], sandbox=env.root)


def test_lora_adapter_of_another_width_is_refused_before_anything_is_written(env, refused, moe, tmp_path):
    """The adapter was trained on a 64-wide model; its --base (the MoE's own) is 32 wide. Baking it used to fail
    with torch's 'size of tensor a (64) must match' after the bake had started."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    wide = save_dense(tmp_path / "wide", "llama", hidden_size=64)
    model = AutoModelForCausalLM.from_pretrained(str(wide), dtype=torch.float32)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]))
    adapter = env.root / "models" / "lora64"
    lora.save_pretrained(str(adapter))
    args = ["experts", "add", str(moe), "--source", str(adapter), "--base", str(env.models["base"]), "--name", "wide"]
    refused(
        [*args, "--prompt", "def", "-o", str(env.outs / "added")],
        ["trained on a model of another width", "(hidden size 64", "(hidden size 32"],
        inputs=[moe, adapter, *env.models.values()],
        sandbox=env.root,
    )


def _export_cases(env, t: dict[str, Path], bad_imatrix: Path) -> dict[str, tuple[list[str], list[str]]]:
    return {
        "budget-onnx": (["--target", "onnx", "--quant", "budget=100K"], ["budget=100K", "gguf target only"]),
        "calibration-blank": (
            ["--quant", "q4_k", "--imatrix", "auto", "--calibration", str(t["blank"])],
            ["--calibration", "only whitespace"],
        ),
        "imatrix-bad-info": (["--quant", "q4_k", "--imatrix", str(bad_imatrix)], [str(bad_imatrix), "not valid JSON"]),
        "moe-kernel-gguf": (["--moe-kernel", "dense"], ["--moe-kernel dense: only the onnx target reads it, not gguf"]),
        "accuracy-level-gguf": (
            ["--accuracy-level", "0"],
            ["--accuracy-level 0: only the onnx target reads it, not gguf"],
        ),
        "accuracy-level-unknown": (
            ["--target", "onnx", "--accuracy-level", "2"],
            ["--accuracy-level 2: choose 0: fp32", "4: int8"],
        ),
        "compute-units-onnx": (
            ["--target", "onnx", "--compute-units", "ALL"],
            ["--compute-units ALL: only the coreml target reads it, not onnx"],
        ),
        "chunk-layers-onnx": (
            ["--target", "onnx", "--chunk-layers", "2"],
            ["--chunk-layers 2: only the coreml, executorch and tflite targets read it, not onnx"],
        ),
        "jobs-gguf": (["--jobs", "2"], ["--jobs 2: only the coreml, executorch and tflite targets read it, not gguf"]),
        "jobs-zero": (["--target", "tflite", "--jobs", "0"], ["--jobs", "greater than or equal to 1"]),
        "eval-text-without-verification": (
            ["--no-verify", "--eval-text", str(t["good"])],
            ["--eval-text", "--no-verify skips it"],
        ),
        "base-of-a-model": (["--base", str(env.models["base"])], ["--base", "is not one"]),
    }


@pytest.mark.parametrize(
    "case",
    [
        "budget-onnx",
        "calibration-blank",
        "imatrix-bad-info",
        "moe-kernel-gguf",
        "accuracy-level-gguf",
        "accuracy-level-unknown",
        "compute-units-onnx",
        "chunk-layers-onnx",
        "jobs-gguf",
        "jobs-zero",
        "eval-text-without-verification",
        "base-of-a-model",
    ],
)
def test_export_option(env, refused, texts, case):
    from quant.test_imatrix import write_imatrix

    bad = write_imatrix(env.work / "bad.imatrix.gguf", info="{not json")
    args, expected = _export_cases(env, texts, bad)[case]
    refused(
        ["export", str(env.models["e1"]), "-o", str(env.outs / "art"), *args],
        expected,
        inputs=[*env.models.values(), *texts.values(), bad],
        sandbox=env.root,
    )


def test_a_short_calibration_text_is_used_with_a_warning_naming_its_tokens(env, tools, texts):
    out = env.outs / "art"
    args = ["export", str(env.models["e1"]), "-o", str(out), "--quant", "q4_k", "--imatrix", "auto"]
    res = tools.runner.invoke(tools.app, [*args, "--calibration", str(texts["short"]), "--no-verify"])
    assert res.exit_code == 0, res.output
    text = tools.squash(res.output)
    assert "warning: the importance matrix is collected on" in text and "fewer than 128" in text, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(manifest["imatrix"]["tokens"].values())
    assert f"collected on {tokens} calibration tokens" in text


def test_train_refuses_a_model_of_another_architecture_than_the_recipe(env, refused, tiny_models):
    """A Qwen2-MoE given to a recipe whose base is a Llama (which merges into Mixtral) was tuned silently."""
    q = tiny_models("qwen2")
    experts = "".join(f"  - {{name: q{i}, source: {q[f'e{i}']}}}\n" for i in (1, 2))
    qwen = env.root / "models" / "qwen-moe"
    api.assemble(
        write_recipe(
            env.root / "qwen.yaml",
            f"name: q\nmethod: mofe\nbase_model: {q['base']}\ngate_mode: random\nexperts_per_token: 1\nexperts:\n"
            + experts,
        ),
        qwen,
    )
    (env.work / "code.txt").write_text(TEXT, encoding="utf-8")
    recipe = env.recipe(
        f"""\
name: tune
method: mofe
base_model: {env.models["base"]}
gate_mode: random
experts_per_token: 1
experts:
  - {{name: a, source: {env.models["e1"]}}}
  - {{name: b, source: {env.models["e2"]}}}
freeze: {{preset: router_only}}
train:
  data: {{code: {{text: code.txt}}}}
  steps: 2
  batch_size: 2
  seq_len: 16
"""
    )
    refused(
        ["train", str(recipe), "--model", str(qwen), "-o", str(env.outs / "tuned")],
        [f"--model {qwen} is a 'qwen2_moe' MoE", "merges its 'llama' base", "into 'mixtral'"],
        inputs=[qwen, recipe, *env.models.values()],
        sandbox=env.root,
        allowed_new=lambda p: p.suffix == ".txt",
    )


HYBRID_RECIPE = """\
name: hy
method: hybrid
experts:
  - {{name: a, source: {a}}}
  - {{name: b, source: {b}}}
router: {{max_length: 32}}
profile: {{lengths: [8, 16, 32]}}
sweep:
  parameter: {parameter}
  values: {values}
"""


def _method_cases(env) -> dict[str, tuple[list[str], list[str]]]:
    """The methods' own commands: values checked and outputs kept off their inputs before any model is read."""
    model = env.root / "models" / "e1"
    recipe = env.recipe(
        HYBRID_RECIPE.format(a=env.models["e1"], b=env.models["e2"], parameter="threshold", values="[0.1]")
    )
    return {
        "embedding-report-lrs-nan": (["embedding", "report", "--lrs", "1e-3,nan"], ["--lrs: 'nan'", "above 0"]),
        "embedding-report-lrs-negative": (["embedding", "report", "--lrs", "-1e-3"], ["--lrs: '-1e-3'"]),
        "embedding-report-over-model": (
            ["embedding", "report", str(model), "-o", str(model), "--force"],
            ["is an input"],
        ),
        "embedding-export-into-model": (
            ["embedding", "export", str(model), "-o", str(model / "onnx")],
            ["is inside the input"],
        ),
        "hybrid-export-over-model": (["hybrid", "export", str(model), "-o", str(model), "--force"], ["is an input"]),
        "comigs-bake-into-model": (["comigs", "bake", str(model), "-o", str(model / "mixtral")], ["inside the input"]),
        "comigs-adapters-around-model": (
            ["comigs", "adapters", str(model), "-o", str(env.root / "models"), "--force"],
            ["contains the input"],
        ),
        "gem-route-tau-nan": (["gem", "route", str(model), "--text", "x", "--tau", "nan"], ["--tau"]),
        "gem-route-tau-above-one": (["gem", "route", str(model), "--text", "x", "--tau", "2"], ["--tau"]),
        "gem-route-log-over-config": (
            ["gem", "route", str(model), "--text", "x", "--log", str(model / "config.json")],
            ["--log", "is inside the input"],
        ),
        "profile-lengths-zero": (["profile", str(model), "--lengths", "0,16"], ["--lengths: 0 is below 1"]),
        "profile-lengths-one": (["profile", str(model), "--lengths", "16,16"], ["at least 2 different values"]),
        "pareto-values-out-of-range": (
            ["hybrid", "pareto", str(recipe), "-o", str(env.outs / "p"), "--parameter", "threshold", "--values", "5"],
            ["--values 5 as loss.threshold", "less than or equal to 1"],
        ),
        "pareto-values-nan": (
            ["hybrid", "pareto", str(recipe), "-o", str(env.outs / "p"), "--values", "0.5,nan"],
            ["--values: 'nan' is not a finite number"],
        ),
        "recipe-sweep-values-out-of-range": (
            [
                "validate",
                str(
                    env.recipe(
                        HYBRID_RECIPE.format(
                            a=env.models["e1"], b=env.models["e2"], parameter="threshold", values="[0.1, 3]"
                        ),
                        "bad.yaml",
                    )
                ),
            ],
            ["bad.yaml:10: sweep.values.1: 3.0 as loss.threshold", "less than or equal to 1"],
        ),
    }


METHOD_CASES = [  # the keys of _method_cases
    "embedding-report-lrs-nan",
    "embedding-report-lrs-negative",
    "embedding-report-over-model",
    "embedding-export-into-model",
    "hybrid-export-over-model",
    "comigs-bake-into-model",
    "comigs-adapters-around-model",
    "gem-route-tau-nan",
    "gem-route-tau-above-one",
    "gem-route-log-over-config",
    "profile-lengths-zero",
    "profile-lengths-one",
    "pareto-values-out-of-range",
    "pareto-values-nan",
    "recipe-sweep-values-out-of-range",
]


@pytest.mark.parametrize("case", METHOD_CASES)
def test_method_command_option(env, refused, case):
    args, expected = _method_cases(env)[case]
    recipes = list(env.work.glob("*.yaml"))
    refused(args, expected, inputs=[*env.models.values(), *recipes], sandbox=env.root)


def test_a_model_card_that_is_not_utf8_is_named(env, refused, moe):
    """An edit rewrites the input's card into the output; a third-party card in Latin-1 was a UnicodeDecodeError."""
    (moe / "README.md").write_bytes("# Mod\xe8le\n".encode("latin-1"))
    refused(
        ["experts", "remove", str(moe), "x1", "-o", str(env.outs / "edited"), "--no-check"],
        [str(moe / "README.md"), "not UTF-8 text"],
        inputs=[moe],
        sandbox=env.root,
    )


@pytest.mark.parametrize(
    ("config", "base", "expected"),
    [
        ({"base_model_name_or_path": 5}, False, ["is a LoRA adapter of 5", "give it with --base"]),
        ({"r": 0}, True, ["adapter_config.json: r is 0, not a positive integer"]),
        ({"r": 4, "lora_alpha": "8"}, True, ["lora_alpha is '8', not a finite number"]),
    ],
)
def test_a_malformed_adapter_config_is_named(env, refused, moe, config, base, expected):
    adapter = env.root / "models" / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4} | config))
    args = ["experts", "add", str(moe), "--source", str(adapter), "--name", "n", "--prompt", "def"]
    args += ["--base", str(env.models["base"])] if base else []
    refused([*args, "-o", str(env.outs / "added")], expected, inputs=[moe, adapter], sandbox=env.root)


def test_gem_eval_of_a_model_whose_kept_recipe_is_not_utf8(env, refused):
    model = env.root / "models" / "gem"
    model.mkdir()
    (model / "moetool-recipe.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    refused(
        ["gem", "eval", str(model)],
        [str(model / "moetool-recipe.yaml"), "not UTF-8 text"],
        inputs=[model],
        sandbox=env.root,
    )
