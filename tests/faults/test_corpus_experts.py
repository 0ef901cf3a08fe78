"""`moetool experts` held to the merge's contract for bad input: every corrupt checkpoint of ``test_corpus.CHECKPOINTS``
given as the MoE to ``list``, ``remove`` and ``extract``, and as the dense source to ``add``; exit code 2, the file
named, no traceback, nothing written, no input changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import write_recipe
from faults.test_corpus import CHECKPOINTS
from moetool import api


@pytest.fixture(scope="module")
def moe(tiny_models, tmp_path_factory) -> Path:
    m = tiny_models("llama")
    tmp = tmp_path_factory.mktemp("corpus-moe")
    experts = "".join(f"  - {{name: x{i}, source: {m[f'e{i}']}, positive_prompts: ['p{i} def']}}\n" for i in (1, 2, 3))
    text = f"name: moe\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\nexperts:\n{experts}"
    return api.assemble(write_recipe(tmp / "moe.yaml", text), tmp / "moe")


def _cases():
    for case, corrupt, expected, where in CHECKPOINTS:
        if "x" in where:  # a model folder given to a command
            for command in ("list", "remove", "extract"):
                yield pytest.param(command, corrupt, expected, id=f"{case}-{command}")
        if "e" in where:
            yield pytest.param("add", corrupt, expected, id=f"{case}-add-source")


@pytest.mark.parametrize(("command", "corrupt", "expected"), list(_cases()))
def test_corrupt_checkpoint_given_to_experts(env, refused, moe, command, corrupt, expected):
    given = env.root / "models" / "moe"
    shutil.copytree(moe, given)
    out = str(env.outs / "edited")
    if command == "add":
        corrupt(env.models["e1"])
        args = ["experts", "add", str(given), "--source", str(env.models["e1"]), "--name", "new", "--prompt", "def"]
        args += ["-o", out]
        named = env.models["e1"]
    else:
        corrupt(given)
        args = {
            "list": ["experts", "list", str(given)],
            "remove": ["experts", "remove", str(given), "x1", "-o", out],
            "extract": ["experts", "extract", str(given), "x1", "-o", out],
        }[command]
        named = given
    refused(args, [str(named), *expected], inputs=[given, *env.models.values()], sandbox=env.root)
