"""The bad-input corpus beyond merge: train, eval, export, inspect and package, held to the merge's contract.

Every case runs ``moetool …`` in-process and asserts what :func:`conftest.run_refused` asserts: exit code 2, the
message naming what is wrong, no traceback, nothing written, no input changed. The corrupt checkpoints of
``test_corpus.CHECKPOINTS`` go through ``train --model`` and ``eval`` too. Property tests feed the command-line
option parsers random text: each input is taken or refused with exit 2, never a traceback.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faults.test_corpus import CHECKPOINTS
from moetool.io.budget import BudgetError, parse_size

FAST = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
TEXT = "def main():\n    return 0\n\nPermission is hereby granted, free of charge.\n" * 40


def _tuning_recipe(env, *, extra: str = "") -> Path:
    (env.work / "code.txt").write_text(TEXT, encoding="utf-8")
    return env.recipe(
        f"""\
name: tune
method: mofe
base_model: {env.models["base"]}
gate_mode: random
experts_per_token: 1
experts:
  - {{name: a, source: {env.models["e1"]}}}
  - {{name: b, source: {env.models["e2"]}}}
freeze: {{preset: mofe}}
train:
  data: {{code: {{text: code.txt}}}}
  steps: 2
  batch_size: 2
  seq_len: 16
{extra}"""
    )


def _texts(env) -> dict[str, Path]:
    good = env.work / "good.txt"
    good.write_text(TEXT, encoding="utf-8")
    latin = env.work / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    empty = env.work / "empty.txt"
    empty.write_text(" \n", encoding="utf-8")
    return {"good": good, "latin": latin, "empty": empty}


def _checkpoint_cases():
    for case, corrupt, expected, where in CHECKPOINTS:
        if "x" in where:  # the cases a model folder given to a command (not a merge input) can have
            for command in ("train", "eval"):
                named = ["config.json"] if case.startswith("config") else expected
                yield pytest.param(command, corrupt, named, id=f"{case}-{command}")


@pytest.mark.parametrize(("command", "corrupt", "expected"), list(_checkpoint_cases()))
def test_corrupt_model_given_to_train_or_eval(env, refused, command, corrupt, expected):
    model = env.root / "models" / "given"
    shutil.copytree(env.models["e1"], model)
    corrupt(model)
    if command == "train":
        r = _tuning_recipe(env)
        args = ["train", str(r), "--model", str(model), "-o", str(env.outs / "tuned")]
        inputs = [model, r]
    else:
        t = _texts(env)["good"]
        args = ["eval", str(model), "--data", f"code={t}", "-o", str(env.outs / "r.json")]
        inputs = [model, t]
    refused(args, [str(model), *expected], inputs=inputs, sandbox=env.root, allowed_new=lambda p: p.suffix == ".txt")


def _eval_cases(env) -> list[tuple[list[str], list[str]]]:
    t = _texts(env)
    m = str(env.models["e1"])
    return [
        (["--data", str(t["good"])], ["Invalid value for --data", "DOMAIN=FILE"]),
        (["--data", "=x"], ["Invalid value for --data", "DOMAIN=FILE"]),
        (["--data", f"code={t['latin']}"], ["latin1.txt:1", "not UTF-8 text (byte 3"]),
        (["--data", f"code={env.work}"], ["is a directory, not a file"]),
        (["--data", f"code={env.work / 'missing.txt'}"], ["missing.txt", "cannot read"]),
        (["--data", f"code={t['good']}", "-o", str(t["good"])], ["is an input"]),
        (["--data", f"code={t['good']}", "-o", str(env.outs)], ["is a directory"]),
        (["--data", f"code={t['good']}", "-o", str(Path(m) / "config.json")], ["is inside the input"]),
        (["--data", f"code={t['good']}", "--seq-len", "0"], ["--seq-len"]),
        (["--data", f"code={t['good']}", "--max-tokens", "-5"], ["--max-tokens"]),
        (["--data", f"code={t['good']}", "--domains", "legal"], ["code is not among --domains legal"]),
        (["--data", f"code={t['good']}", "--dtype", "int8"], ["--dtype 'int8'"]),
        (["--data", f"code={t['good']}", "--device", "tpu"], ["--device 'tpu'"]),
        (["--data", f"code={t['good']}", "--device", "cuda:7"], ["CUDA device"]),
        (["--data", f"code={t['good']}", "--own", "nonsense"], ["Invalid value for --own", "MODEL=DOMAIN"]),
        (["--data", f"code={t['good']}", "--limit", "0"], ["--limit"]),
        (["--data", f"code={t['empty']}"], ["empty.txt", "no text to score"]),
        (["--data", "code=a\x00b"], ["cannot contain a NUL byte"]),  # found by the property test below
    ]


@pytest.mark.parametrize("case", range(18))
def test_eval_option(env, refused, case):
    pytest.importorskip("torch")
    if case == 13:
        import torch

        if torch.cuda.device_count() > 7:
            pytest.skip("this machine has the device")
    args, expected = _eval_cases(env)[case]
    t = _texts(env)
    refused(
        ["eval", str(env.models["e1"]), *args],
        expected,
        inputs=[*env.models.values(), *t.values()],
        sandbox=env.root,
    )


def _train_cases(env) -> list[tuple[list[str], str, list[str]]]:
    """(options, recipe extra, expected)."""
    moe = str(env.models["e1"])
    return [
        (["--dtype", "int8"], "", ["--dtype 'int8'"]),
        (["--device", "tpu"], "", ["--device 'tpu'"]),
        ([], "  learning_rate: .inf\n", ["train.learning_rate"]),
        ([], "  router_learning_rate: .nan\n", ["train.router_learning_rate"]),
        ([], "  max_grad_norm: .inf\n", ["train.max_grad_norm"]),
        ([], "  steps: 0\n", ["train.steps"]),
        (["--model", str(Path(moe) / "config.json")], "", ["not a checkpoint directory"]),
    ]


@pytest.mark.parametrize("case", range(7))
def test_train_option(env, refused, case):
    opts, extra, expected = _train_cases(env)[case]
    r = _tuning_recipe(env, extra=extra)
    model = [] if "--model" in opts else ["--model", str(env.models["e1"])]
    refused(
        ["train", str(r), *model, *opts, "-o", str(env.outs / "tuned")],
        expected,
        inputs=[*env.models.values(), r],
        sandbox=env.root,
        allowed_new=lambda p: p.suffix == ".txt",
    )


def _export_cases(env) -> list[tuple[list[str], list[str]]]:
    t = _texts(env)
    return [
        (["--context", "0"], ["--context"]),
        (["--quant", "blk.0.ffn_nothing*=q4_0,*=q8_0"], ["matches no tensor"]),
        (["--quant", "experts=q8_0,*=f16"], ["'experts=q8_0' matches no tensor"]),  # a dense model has no experts
        (["--eval-text", str(t["latin"])], ["latin1.txt:1", "not UTF-8"]),
        (["--eval-text", str(env.work / "missing.txt")], ["missing.txt", "cannot read"]),
        (["--target", "onnx", "--quant", "layers.99.*=q4_0,*=q8_0"], ["matches no tensor"]),
        # importance matrices (GGUF)
        (["--imatrix", str(env.work / "missing.imatrix.gguf")], ["missing.imatrix.gguf", "no such file"]),
        (["--imatrix", str(t["good"])], ["good.txt", "not a GGUF imatrix"]),
        (["--imatrix", "auto", "--calibration", str(t["good"]), "--imatrix-mode", "sometimes"], ["--imatrix-mode"]),
        (["--calibration", str(t["good"])], ["--calibration is for --imatrix auto"]),
        (["--quant", "iq4_nl"], ["iq4_nl need an importance matrix", "--imatrix auto"]),
        (["--quant", "budget=lots"], ["--quant budget", "not a size"]),
        (["--quant", "budget=inf"], ["--quant budget", "not a size"]),
        (["--imatrix", "auto", "--calibration", str(t["latin"])], ["latin1.txt:1", "not UTF-8"]),
        (["--target", "onnx", "--imatrix", "auto"], ["--imatrix is for the gguf target"]),
        (["--imatrix", "auto"], ["no recipe with train.data", "--calibration FILE"]),
        (["--quant", "budget=10000", "--imatrix", "auto", "--calibration", str(t["good"])], ["cheapest plan needs"]),
    ]


@pytest.mark.parametrize("case", range(17))
def test_export_option(env, refused, case):
    args, expected = _export_cases(env)[case]
    t = _texts(env)
    refused(
        ["export", str(env.models["e1"]), "-o", str(env.outs / "art"), *args],
        expected,
        inputs=[*env.models.values(), *t.values()],
        sandbox=env.root,
    )


def test_merge_device_is_checked_before_any_work(env, refused):
    r = _tuning_recipe(env)
    refused(
        ["merge", str(r), "-o", str(env.outs / "m"), "--device", "tpu"],
        ["--device 'tpu'"],
        inputs=[r],
        sandbox=env.root,
    )


def test_training_options_a_method_does_not_take_are_refused(env, refused):
    """``--dtype`` for CoMiGS training would have been parsed and ignored."""
    from comigs_fixtures import two_user_recipe

    work = env.work / "comigs"
    work.mkdir()
    r = two_user_recipe(work)
    refused(
        ["train", str(r), "-o", str(env.outs / "c"), "--dtype", "bfloat16"],
        ["--dtype", "not an option of CoMiGS"],
        inputs=[work],
        sandbox=env.outs,
    )


def test_package_refuses_a_link_out_of_the_model(env, refused, cli):
    r = _tuning_recipe(env)
    moe = env.outs / "moe"
    assert cli(["merge", str(r), "-o", str(moe)]).exit_code == 0
    secret = env.root / "secret.txt"
    secret.write_text("token\n")
    (moe / "special_tokens_map.json").unlink(missing_ok=True)
    (moe / "special_tokens_map.json").symlink_to(secret)
    refused(
        ["package", str(moe), "-o", str(env.outs / "repo")],
        ["is a link to", "secret.txt"],
        inputs=[moe, secret],
        sandbox=env.root,
    )


@FAST
@given(st.text(max_size=40))
def test_eval_data_option_any_text(env, cli, value):
    """Any text as ``--data``: evaluated, or refused with exit 2 and no traceback."""
    res = cli(["eval", str(env.models["e1"]), "--data", value, "--max-tokens", "64", "--seq-len", "8"])
    assert "Traceback" not in res.output and res.exit_code in (0, 2), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


@FAST
@given(st.text(max_size=20))
def test_size_parser_any_text(value):
    try:
        assert parse_size(value, what="X") >= 0
    except BudgetError as exc:
        assert "X=" in str(exc)


@pytest.mark.parametrize(("key", "value"), [("num_hidden_layers", "two"), ("hidden_size", 32.5), ("vocab_size", 0)])
@pytest.mark.parametrize("command", ["inspect", "eval", "export"])
def test_config_sizes_that_are_not_positive_integers(env, refused, key, value, command):
    """``moetool inspect`` printed ``layers: two`` and exited 0; every command reading the config now names it."""
    import json

    model = env.root / "models" / "given"
    shutil.copytree(env.models["e1"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))
    t = _texts(env)["good"]
    args = {
        "inspect": ["inspect", str(model)],
        "eval": ["eval", str(model), "--data", f"code={t}"],
        "export": ["export", str(model), "-o", str(env.outs / "art"), "--no-verify"],
    }[command]
    refused(
        args,
        ["config.json", f"{key} is {value!r}, not a positive integer"],
        inputs=[model, t],
        sandbox=env.root,
        allowed_new=lambda p: p.suffix == ".txt",
    )


def _other_cases(env) -> list[tuple[list[str], list[str]]]:
    return [
        (["zoo", "build", "--profile", "huge"], ["unknown zoo profile 'huge'"]),
        (["zoo", "build", "--profile", "smollm2", "--expert-steps", "0"], ["--expert-steps"]),
        (["push", str(env.work / "nowhere"), "--repo-id", "a/b", "--dry-run"], ["nowhere: no such directory"]),
        (["push", str(env.models["e1"]), "--repo-id", "a/b", "--dry-run"], ["no README.md", "moetool package"]),
        (["package", str(env.work / "nowhere"), "-o", str(env.outs / "repo")], ["nowhere: no such directory"]),
        (["inspect", str(env.work / "nowhere")], ["nowhere"]),
    ]


@pytest.mark.parametrize("case", range(6))
def test_zoo_push_package_inspect(env, refused, case):
    args, expected = _other_cases(env)[case]
    refused(args, expected, inputs=list(env.models.values()), sandbox=env.root)
