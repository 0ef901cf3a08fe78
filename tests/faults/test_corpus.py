"""The bad-input corpus: every broken recipe, checkpoint and output path gets one clean error (issue 20).

Each case runs in-process through the command line (``moetool validate``, ``merge --dry-run``, ``merge -o``,
``export --dry-run``, ``export -o``) and asserts: exit code 2, the file and the field or tensor named, no traceback,
nothing written, no input changed (by checksum). Cases whose check belongs to a later stage of a command (prompts that
tokenize to nothing, outputs inside inputs, NaN tensors, …) are marked ``xfail(strict=True)`` until that stage is
wired; see ``WIRING``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

GOOD = """\
name: faults
method: mofe
base_model: {base}
gate_mode: hidden
experts_per_token: 1
experts:
  - name: a
    source: {e1}
    positive_prompts: ["def main(): import os"]
  - name: b
    source: {e2}
    positive_prompts: ["Permission is hereby granted"]
"""
# lines: 1 name, 2 method, 3 base_model, 4 gate_mode, 5 experts_per_token, 6 experts, 7-9 expert a, 10-12 expert b


def good(env, **models: Path) -> str:
    m = {**env.models, **models}
    return GOOD.format(base=m["base"], e1=m["e1"], e2=m["e2"])


def _bomb() -> str:
    text = 'lol0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, 10):
        text += f"lol{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 10) + "]\n"
    return text


Edit = Callable[[str], "str | bytes"]

# (id, edit of the good recipe, texts the message must contain besides the file name)
RECIPES: list[tuple[str, Edit, list[str]]] = [
    # encoding, size, YAML structure
    ("binary", lambda t: bytes(range(256)) * 8, ["r.yaml:", "not UTF-8"]),
    (
        "latin-1",
        lambda t: t.replace("name: faults", "name: caf\xe9").encode("latin-1"),
        ["r.yaml:1:", "not UTF-8", "byte 9"],
    ),
    ("utf-16", lambda t: t.encode("utf-16"), ["r.yaml:1:", "not UTF-8", "byte 0"]),
    ("nul-byte", lambda t: t.replace("faults", "fau\x00lts"), ["r.yaml:1:", "not valid YAML"]),
    ("too-large", lambda t: t + "# " + "x" * (1024 * 1024) + "\n", ["r.yaml:", "more than the 1,048,576 allowed"]),
    ("empty", lambda t: "", ["r.yaml:", "a recipe must be a YAML mapping"]),
    ("only-comment", lambda t: "# nothing\n", ["a recipe must be a YAML mapping"]),
    ("top-level-list", lambda t: "- name: x\n", ["a recipe must be a YAML mapping"]),
    ("top-level-scalar", lambda t: "mofe\n", ["a recipe must be a YAML mapping"]),
    ("two-documents", lambda t: t + "---\nname: other\n", ["r.yaml:13:", "not valid YAML"]),
    ("unclosed-bracket", lambda t: t + "experts_extra: [oops\n", ["not valid YAML"]),
    ("bad-indent", lambda t: t.replace("    source: ", "   source: ", 1), ["r.yaml:8:", "not valid YAML"]),
    ("tab-indent", lambda t: t.replace("    source: ", "\tsource: ", 1), ["r.yaml:8:", "not valid YAML"]),
    ("deep-flow", lambda t: t + "x: " + "[" * 10_000 + "]" * 10_000 + "\n", ["r.yaml:13:", "nested deeper than 64"]),
    ("deep-block", lambda t: t + "x:\n" + "".join("  " * i + "k:\n" for i in range(1, 100)), ["nested deeper than 64"]),
    ("alias-bomb", lambda t: t + _bomb(), ["once aliases are expanded"]),
    ("alias-flood", lambda t: t + "z: &z 1\nzz: [" + ",".join(["*z"] * 300) + "]\n", ["more than 256 aliases"]),
    ("python-tag", lambda t: t + "x: !!python/object/apply:os.system [ls]\n", ["r.yaml:13:", "not valid YAML"]),
    ("bad-date", lambda t: t.replace("name: faults", "name: 2001-02-30"), ["r.yaml:", "cannot read"]),
    ("unhashable-key", lambda t: t + "? [a, b]\n: 1\n", ["not valid YAML", "unhashable"]),
    # duplicate keys: the second would silently win
    ("dup-top-key", lambda t: t + "gate_mode: random\n", ["r.yaml:13: gate_mode: duplicate key", "first at line 4"]),
    ("dup-base", lambda t: t + "base_model: elsewhere\n", ["r.yaml:13: base_model: duplicate key", "first at line 3"]),
    (
        "dup-expert-source",
        lambda t: t.replace('    positive_prompts: ["def', '    source: zoo:code\n    positive_prompts: ["def', 1),
        ["r.yaml:9: experts.0.source: duplicate key 'source' (first at line 8)"],
    ),
    (
        "dup-flow-key",
        lambda t: t + "freeze: {preset: mofe, preset: full}\n",
        ["r.yaml:13: freeze.preset: duplicate key"],
    ),
    # strict types: no string or bool for an int
    (
        "ept-string",
        lambda t: t.replace("experts_per_token: 1", 'experts_per_token: "1"'),
        ["r.yaml:5: experts_per_token: Input should be a valid integer", "remove the quotes"],
    ),
    (
        "ept-true",
        lambda t: t.replace("experts_per_token: 1", "experts_per_token: true"),
        ["r.yaml:5: experts_per_token:", "not the boolean True"],
    ),
    (
        "ept-float",
        lambda t: t.replace("experts_per_token: 1", "experts_per_token: 1.5"),
        ["r.yaml:5: experts_per_token:"],
    ),
    (
        "ept-null",
        lambda t: t.replace("experts_per_token: 1", "experts_per_token: null"),
        ["r.yaml:5: experts_per_token:"],
    ),
    (
        "ept-zero",
        lambda t: t.replace("experts_per_token: 1", "experts_per_token: 0"),
        ["experts_per_token: Input should be greater than or equal to 1"],
    ),
    ("ept-negative", lambda t: t.replace("experts_per_token: 1", "experts_per_token: -3"), ["experts_per_token:"]),
    (
        "ept-too-many",
        lambda t: t.replace("experts_per_token: 1", "experts_per_token: 3"),
        ["experts_per_token: 3 is larger than the number of experts (2)"],
    ),
    (
        "ept-list",
        lambda t: t.replace("experts_per_token: 1", "experts_per_token: [1]"),
        ["r.yaml:5: experts_per_token:"],
    ),
    ("seed-string", lambda t: t + 'seed: "0"\n', ["r.yaml:13: seed:", "remove the quotes"]),
    ("seed-exp", lambda t: t + "seed: 1e3\n", ["r.yaml:13: seed:", "valid integer"]),
    ("shard-size-string", lambda t: t + "max_shard_size: 1GB\n", ["r.yaml:13: max_shard_size:"]),
    ("shard-size-small", lambda t: t + "max_shard_size: 10\n", ["r.yaml:13: max_shard_size:"]),
    ("chat-template-string", lambda t: t + 'chat_template: "yes"\n', ["r.yaml:13: chat_template:", "valid boolean"]),
    ("chat-template-int", lambda t: t + "chat_template: 1\n", ["r.yaml:13: chat_template:", "valid boolean"]),
    ("norm-topk-string", lambda t: t + "norm_topk_prob: 'false'\n", ["r.yaml:13: norm_topk_prob:"]),
    ("train-steps-bool", lambda t: t + "train:\n  steps: yes\n", ["r.yaml:14: train.steps:"]),
    ("train-lr-string", lambda t: t + "train:\n  learning_rate: fast\n", ["r.yaml:14: train.learning_rate:"]),
    ("train-batch-float", lambda t: t + "train:\n  batch_size: 8.0\n", ["r.yaml:14: train.batch_size:"]),
    # enums, unknown keys, missing fields
    ("dtype", lambda t: t + "dtype: float64\n", ["r.yaml:13: dtype:"]),
    ("gate-mode", lambda t: t.replace("gate_mode: hidden", "gate_mode: magic"), ["r.yaml:4: gate_mode:"]),
    ("architecture", lambda t: t + "architecture: switch\n", ["r.yaml:13: architecture:"]),
    ("method-missing", lambda t: t.replace("method: mofe\n", ""), ["method: None is not a known method"]),
    (
        "method-unknown",
        lambda t: t.replace("method: mofe", "method: mofee"),
        ["r.yaml:2: method: 'mofee' is not a known method", "did you mean 'mofe'"],
    ),
    (
        "method-list",
        lambda t: t.replace("method: mofe", "method: [mofe]"),
        ["r.yaml:2: method: ['mofe'] is not a known method"],
    ),
    ("method-int", lambda t: t.replace("method: mofe", "method: 3"), ["r.yaml:2: method: 3 is not a known method"]),
    ("name-missing", lambda t: t.replace("name: faults\n", ""), ["name: Field required"]),
    ("name-int", lambda t: t.replace("name: faults", "name: 42"), ["r.yaml:1: name:", "valid string"]),
    ("name-spaces", lambda t: t.replace("name: faults", "name: my model"), ["r.yaml:1: name:"]),
    ("base-missing", lambda t: t.replace(t.splitlines()[2] + "\n", ""), ["base_model: Field required"]),
    (
        "base-list",
        lambda t: t.replace("base_model: ", "base_model: [", 1).replace("\ngate_mode", "]\ngate_mode"),
        ["r.yaml:3: base_model:"],
    ),
    ("unknown-key", lambda t: t + "gate_mod: random\n", ["r.yaml:13: gate_mod: unknown key"]),
    (
        "unknown-expert-key",
        lambda t: t.replace('    positive_prompts: ["def', '    positve_prompts: ["def', 1),
        ["r.yaml:9: experts.0.positve_prompts: unknown key"],
    ),
    ("experts-empty", lambda t: t[: t.index("experts:\n")] + "experts: []\n", ["r.yaml:6: experts:"]),
    (
        "experts-mapping",
        lambda t: t[: t.index("experts:\n")] + "experts: {a: x}\n",
        ["r.yaml:6: experts:", "valid list"],
    ),
    ("experts-scalar", lambda t: t[: t.index("experts:\n")] + "experts: 2\n", ["r.yaml:6: experts:"]),
    ("expert-no-source", lambda t: t.replace(t.splitlines()[7] + "\n", ""), ["experts.0.source: Field required"]),
    (
        "expert-source-int",
        lambda t: t.replace(t.splitlines()[7], "    source: 7"),
        ["r.yaml:8: experts.0.source:", "valid string"],
    ),
    (
        "expert-name-dup",
        lambda t: t.replace("name: b", "name: a"),
        ["r.yaml:10: experts.1.name: duplicate expert name 'a'"],
    ),
    ("expert-name-bad", lambda t: t.replace("name: b", "name: ../b"), ["r.yaml:10: experts.1.name:"]),
    ("expert-is-string", lambda t: t[: t.index("  - name: b")] + "  - just-a-string\n", ["r.yaml:10: experts.1:"]),
    # prompts
    (
        "prompt-empty",
        lambda t: t.replace('["def main(): import os"]', '[""]'),
        ["r.yaml:9: experts.0.positive_prompts.0: prompt '' has no text"],
    ),
    (
        "prompt-blank",
        lambda t: t.replace('["def main(): import os"]', '["  \\t "]'),
        ["r.yaml:9: experts.0.positive_prompts.0:", "has no text"],
    ),
    (
        "prompt-newlines",
        lambda t: t.replace('["def main(): import os"]', '["\\n\\n"]'),
        ["experts.0.positive_prompts.0:", "has no text"],
    ),
    (
        "negative-empty",
        lambda t: t.replace('["def main(): import os"]', '["def"]\n    negative_prompts: [""]'),
        ["r.yaml:10: experts.0.negative_prompts.0:", "has no text"],
    ),
    (
        "prompt-not-list",
        lambda t: t.replace('["def main(): import os"]', '"def main()"'),
        ["r.yaml:9: experts.0.positive_prompts:", "valid list"],
    ),
    (
        "prompt-int",
        lambda t: t.replace('["def main(): import os"]', "[1, 2]"),
        ["r.yaml:9: experts.0.positive_prompts.0:", "valid string"],
    ),
    (
        "prompts-missing",
        lambda t: t.replace('    positive_prompts: ["Permission is hereby granted"]\n', ""),
        ["experts.1.positive_prompts: expert 'b' has no positive prompts"],
    ),
    # cross-field and nested sections
    (
        "shared-mixtral",
        lambda t: t + "shared_expert: {source: x}\narchitecture: mixtral\n",
        ["shared_expert: only the qwen2_moe architecture"],
    ),
    (
        "shared-prompt-empty",
        lambda t: t + 'shared_expert: {source: x, positive_prompts: [" "]}\n',
        ["r.yaml:13: shared_expert.positive_prompts.0:", "has no text"],
    ),
    (
        "norm-topk-mixtral",
        lambda t: t + "norm_topk_prob: false\narchitecture: mixtral\n",
        ["norm_topk_prob: mixtral always renormalises"],
    ),
    ("freeze-preset", lambda t: t + "freeze: {preset: everything}\n", ["r.yaml:13: freeze.preset:"]),
    ("freeze-list", lambda t: t + "freeze: [mofe]\n", ["r.yaml:13: freeze:", "not the list"]),
    ("quant-preset", lambda t: t + "quantization: {preset: q9_9}\n", ["r.yaml:13: quantization.preset:"]),
    (
        "quant-rule-type",
        lambda t: t + "quantization:\n  rules: [{role: experts, type: q9}]\n",
        ["r.yaml:14: quantization.rules.0.type:"],
    ),
    ("target-unknown", lambda t: t + "targets: [{target: tensorrt}]\n", ["r.yaml:13: targets.0.target:"]),
    (
        "target-context-string",
        lambda t: t + "targets: [{target: gguf, context: '2048'}]\n",
        ["r.yaml:13: targets.0.context:", "remove the quotes"],
    ),
    (
        "train-data-bad",
        lambda t: t + "train:\n  data: {code: {zoo: code, colour: red}}\n",
        ["r.yaml:14: train.data.code.colour: unknown key"],
    ),
]

COMMANDS = {
    "validate": lambda env, r: ["validate", str(r)],
    "merge-dry": lambda env, r: ["merge", str(r), "--dry-run"],
    "merge": lambda env, r: ["merge", str(r), "-o", str(env.outs / "moe")],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(("case", "edit", "expected"), RECIPES, ids=[c[0] for c in RECIPES])
def test_bad_recipe(env, refused, command, case, edit, expected):
    r = env.recipe(edit(good(env)))
    refused(
        COMMANDS[command](env, r),
        ["r.yaml", *expected],
        inputs=[r, *env.models.values()],
        sandbox=env.root,
    )


def test_recipe_file_missing_or_a_directory(env, refused):
    for path in (env.work / "nope.yaml", env.models["e1"]):
        for command in COMMANDS.values():
            refused(
                command(env, path),
                [str(path), "cannot read recipe" if path.name == "nope.yaml" else "is a directory"],
                inputs=list(env.models.values()),
                sandbox=env.root,
            )


def test_alias_bomb_and_deep_nesting_are_fast(env, refused):
    """Refused in seconds of CPU, not the minutes an expansion takes (process time: other work does not count)."""
    import resource
    import time

    refused(["validate", str(env.recipe("x: 1\n"))], ["r.yaml"], inputs=[], sandbox=env.root)  # imports warm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for edit in (lambda t: t + _bomb(), lambda t: t + "x: " + "[" * 100_000 + "\n"):
        r = env.recipe(edit(good(env)))
        t0 = time.process_time()
        refused(["validate", str(r)], ["r.yaml"], inputs=[r], sandbox=env.root)
        # 0.6 s here, 1.23 s on a slower CI machine: PyYAML's scanner reads every `[` before the composer refuses
        assert time.process_time() - t0 < 5.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 * 1024  # KiB: bounded memory


# --- corrupt checkpoints ---------------------------------------------------------------------------------------------

ST = "model.safetensors"


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rewrite(d: Path, fn: Callable[[dict], object]) -> None:
    header, data = _split(d / ST)
    new = fn(header)
    raw = (new if isinstance(new, str) else json.dumps(new if new is not None else header)).encode()
    (d / ST).write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _first(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _set_entry(key: str, value: object) -> Callable[[dict], dict]:
    def fn(h: dict) -> dict:
        h[_first(h)][key] = value
        return h

    return fn


def _raw_header(d: Path, text: bytes) -> None:
    _, data = _split(d / ST)
    (d / ST).write_bytes(struct.pack("<Q", len(text)) + text + data)


def _length(d: Path, n: int) -> None:
    raw = (d / ST).read_bytes()
    (d / ST).write_bytes(struct.pack("<Q", n) + raw[8:])


def _random(d: Path) -> None:
    size = (d / ST).stat().st_size
    (d / ST).write_bytes(random.Random(20).randbytes(size))


def _truncate(d: Path) -> None:
    raw = (d / ST).read_bytes()
    (d / ST).write_bytes(raw[: len(raw) // 2])


def _index(d: Path, extra_shard: str | None = None, text: str | None = None) -> None:
    header, _ = _split(d / ST)
    weight_map = {k: ST for k in header if k != "__metadata__"}
    if extra_shard is not None:
        weight_map[_first(header)] = extra_shard
    (d / "model.safetensors.index.json").write_text(
        text if text is not None else json.dumps({"weight_map": weight_map})
    )


def _pickle_only(d: Path) -> None:
    from safetensors.torch import load_file

    torch.save(load_file(str(d / ST)), d / "pytorch_model.bin")
    (d / ST).unlink()


def _write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def fn(d: Path) -> None:
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())

    return fn


def _delete(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


# (id, corruption of a model dir, texts the message names, where it applies: merge as expert, merge as base, export)
CHECKPOINTS: list[tuple[str, Callable[[Path], None], list[str], str]] = [
    ("st-zero-bytes", _write(ST, b""), [ST, "shorter than the 8-byte header length"], "ebx"),
    ("st-five-bytes", _write(ST, b"\x01\x02\x03\x04\x05"), [ST, "5 bytes, shorter than"], "ebx"),
    ("st-len-2**62", lambda d: _length(d, 2**62), [ST, "over the 100,000,000-byte limit"], "ebx"),
    ("st-len-past-end", lambda d: _length(d, 10**7), [ST, "runs past the end"], "ebx"),
    (
        "st-garbage-json",
        lambda d: _raw_header(d, b"{garbage: yes"),
        [ST, "safetensors header is not valid JSON"],
        "ebx",
    ),
    ("st-random-bytes", _random, [ST, "not a valid safetensors file"], "ebx"),
    ("st-not-utf8", lambda d: _raw_header(d, b'{"\xff": 1}'), [ST, "not UTF-8"], "ebx"),
    ("st-header-list", lambda d: _rewrite(d, lambda h: [1, 2]), [ST, "must be a JSON object"], "ebx"),
    ("st-dup-tensor", lambda d: _raw_header(d, b'{"a": {}, "a": {}}'), [ST, "has the key 'a' twice"], "ebx"),
    (
        "st-entry-not-object",
        lambda d: _rewrite(d, lambda h: {**h, _first(h): 5}),
        [ST, "header entry must be an object"],
        "ebx",
    ),
    ("st-bad-dtype", lambda d: _rewrite(d, _set_entry("dtype", "F9")), [ST, "unknown dtype 'F9'"], "ebx"),
    ("st-negative-shape", lambda d: _rewrite(d, _set_entry("shape", [-1, 4])), [ST, "shape must be"], "ebx"),
    ("st-shape-mismatch", lambda d: _rewrite(d, _set_entry("shape", [1])), [ST, "data_offsets span"], "ebx"),
    (
        "st-offsets-reversed",
        lambda d: _rewrite(d, _set_entry("data_offsets", [8, 0])),
        [ST, "data_offsets must be"],
        "ebx",
    ),
    (
        "st-offsets-past-end",
        lambda d: _rewrite(d, _set_entry("data_offsets", [10**9, 10**9])),
        [ST, "data_offsets span"],
        "ebx",
    ),
    (
        "st-metadata-list",
        lambda d: _rewrite(d, lambda h: {**h, "__metadata__": [1]}),
        [ST, "__metadata__ must be an object"],
        "ebx",
    ),
    ("st-truncated", _truncate, [ST, "past the end of the"], "ebx"),
    ("config-garbage", _write("config.json", "{"), ["config.json:1:2: model config is not valid JSON"], "ex"),
    ("config-empty", _write("config.json", ""), ["config.json", "not valid JSON"], "ex"),
    ("config-list", _write("config.json", "[1]"), ["config.json", "must be a JSON object"], "ex"),
    (
        "config-latin1",
        _write("config.json", '{"model_type": "caf\xe9"}'.encode("latin-1")),
        ["config.json", "not UTF-8"],
        "ex",
    ),
    ("config-dup-key", _write("config.json", '{"hidden_size": 32, "hidden_size": 64}'), ["config.json", "twice"], "ex"),
    ("config-missing", _delete("config.json"), ["no config.json"], "ebx"),
    (
        "index-missing-shard",
        lambda d: _index(d, "model-00002-of-00002.safetensors"),
        ["model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing"],
        "ebx",
    ),
    ("index-garbage", lambda d: _index(d, text="{"), ["model.safetensors.index.json", "not valid JSON"], "ebx"),
    (
        "index-no-map",
        lambda d: _index(d, text='{"metadata": {}}'),
        ["model.safetensors.index.json", "weight_map must be"],
        "ebx",
    ),
    (
        "index-traversal",
        lambda d: _index(d, "../e2/model.safetensors"),
        ["model.safetensors.index.json", "is not a file name"],
        "ebx",
    ),
    (
        "index-tensor-not-in-shard",
        lambda d: _index(d, text=json.dumps({"weight_map": {"ghost": ST}})),
        ["model.safetensors.index.json", "'ghost'"],
        "ebx",
    ),
    ("no-weights", _delete(ST), ["no *.safetensors weights"], "ebx"),
    ("pickle-only", _pickle_only, ["pytorch_model*.bin", "--allow-pickle"], "eb"),
]


def _checkpoint_cases():
    for case, corrupt, expected, where in CHECKPOINTS:
        for role, flag in (("expert", "e"), ("base", "b")):
            if flag in where:
                for command in ("merge-dry", "merge"):
                    # the base's config is read by transformers' AutoConfig: its message names the file, not the fault
                    named = ["config.json"] if role == "base" and case.startswith("config") else expected
                    yield pytest.param(role, command, corrupt, named, id=f"{case}-{role}-{command}")
        if "x" in where:
            # export reads config.json first in methods/base.py config_model_type: the file, not yet the detail
            named = ["config.json"] if case.startswith("config") else expected
            for command in ("export-dry", "export"):
                yield pytest.param("export", command, corrupt, named, id=f"{case}-{command}")


@pytest.mark.parametrize(("role", "command", "corrupt", "expected"), list(_checkpoint_cases()))
def test_corrupt_checkpoint(env, refused, role, command, corrupt, expected):
    key = {"expert": "e1", "base": "base", "export": "e1"}[role]
    corrupt(env.models[key])
    if role == "export":
        args = ["export", str(env.models[key]), "-o", str(env.outs / "art")]
        args += ["--dry-run"] if command == "export-dry" else ["--no-verify"]
        r = None
    else:
        r = env.recipe(good(env))
        args = COMMANDS[command](env, r)
    refused(
        args, [str(env.models[key]), *expected], inputs=[*env.models.values(), *([r] if r else [])], sandbox=env.root
    )


def test_corrupt_pickle_with_allow_pickle(env, refused):
    _pickle_only(env.models["e1"])
    (env.models["e1"] / "pytorch_model.bin").write_bytes(b"\x80\x04garbage")
    r = env.recipe(good(env))
    for args in (
        ["merge", str(r), "--dry-run", "--allow-pickle"],
        ["merge", str(r), "-o", str(env.outs / "m"), "--allow-pickle"],
    ):
        refused(
            args,
            ["pytorch_model.bin", "cannot load pickle weights"],
            inputs=[r, *env.models.values()],
            sandbox=env.root,
        )


# --- output paths ----------------------------------------------------------------------------------------------------


def test_output_exists_without_force(env, refused):
    r = env.recipe(good(env).replace("gate_mode: hidden", "gate_mode: random"))
    out = env.outs / "moe"
    out.mkdir()
    (out / "keep").write_text("mine")
    for args in (["merge", str(r), "-o", str(out)], ["export", str(env.models["e1"]), "-o", str(out), "--no-verify"]):
        refused(args, [str(out), "--force"], inputs=[r, out, *env.models.values()], sandbox=env.root)


@pytest.mark.parametrize("target", ["", ".", "afile/out", "afile/deeper/out"])
@pytest.mark.parametrize("command", ["merge", "export"])
def test_bad_output_path(env, refused, command, target):
    (env.work / "afile").write_text("not a directory")
    r = env.recipe(good(env).replace("gate_mode: hidden", "gate_mode: random"))
    args = ["merge", str(r)] if command == "merge" else ["export", str(env.models["e1"]), "--no-verify"]
    expected = {"": ["output"], ".": ["output", "name a new directory"]}.get(target, ["afile", "a file"])
    refused([*args, "-o", target, "--force"], expected, inputs=[r, *env.models.values(), env.work], sandbox=env.root)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_parent(env, refused):
    ro = env.outs / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = env.recipe(good(env).replace("gate_mode: hidden", "gate_mode: random"))
        refused(["merge", str(r), "-o", str(ro / "moe")], [str(ro), "ermission"], inputs=[r], sandbox=env.root)
    finally:
        ro.chmod(0o755)


def test_export_of_a_half_written_folder(env, refused):
    half = env.outs / "half"
    half.mkdir()
    shutil.copy(env.models["e1"] / "config.json", half / "config.json")
    refused(
        ["export", str(half), "-o", str(env.outs / "art"), "--dry-run"],
        [str(half), "no *.safetensors weights"],
        inputs=[half],
        sandbox=env.root,
    )


# --- cases that need a check wired into a command: xfail(strict) until the pipeline does it -------------------------

WIRING = "needs wiring in pipeline: "


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("where", ["expert-dir", "inside-expert", "parent-of-inputs", "recipe-dir"])
def test_output_must_not_touch_inputs(env, refused, where):
    (env.root / "recipes").mkdir()
    r = env.root / "recipes" / "r.yaml"  # the recipe file is an input too: its folder is not a valid output
    r.write_text(good(env).replace("gate_mode: hidden", "gate_mode: random"))
    target = {
        "expert-dir": env.models["e1"],
        "inside-expert": env.models["e1"] / "moe",
        "parent-of-inputs": env.models["e1"].parent,
        "recipe-dir": r.parent,
    }[where]
    refused(
        ["merge", str(r), "-o", str(target), "--force"],
        ["output", "input"],
        inputs=[r, *env.models.values()],
        sandbox=env.root,
    )


@pytest.mark.parametrize("where", ["model-dir", "inside-model"])
def test_export_output_must_not_touch_the_model(env, refused, where):
    target = env.models["e1"] if where == "model-dir" else env.models["e1"] / "art"
    refused(
        ["export", str(env.models["e1"]), "-o", str(target), "--force", "--no-verify"],
        ["output", "input"],
        inputs=list(env.models.values()),
        sandbox=env.root,
    )


@pytest.mark.parametrize("command", ["merge-dry", "merge"])
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
@pytest.mark.parametrize("role", ["e1", "base"])
def test_malformed_tokenizer_file(env, refused, role, name, command):
    (env.models[role] / name).write_text("{")
    r = env.recipe(good(env))
    refused(
        COMMANDS[command](env, r), [str(env.models[role] / name)], inputs=[r, *env.models.values()], sandbox=env.root
    )


def test_export_refuses_a_moetool_temp_dir(env, refused):
    tmp = env.outs / f".moe.moetool-tmp-{_dead_pid()}-abcd"
    shutil.copytree(env.models["e1"], tmp)
    refused(
        ["export", str(tmp), "-o", str(env.outs / "art"), "--dry-run"],
        ["moetool temporary directory"],
        inputs=[tmp],
        sandbox=env.root,
    )


def _tokenizer_without_template(d: Path) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)


# (id, edit of the good recipe, fields named, command) — checks that need the tokenizer or the base's config
PROMPTS = [
    ("special-token-only", lambda t: t.replace('"def main(): import os"', '"<s>"'), ["experts.0.positive_prompts.0"]),
    (
        "special-tokens-only",
        lambda t: t.replace('"def main(): import os"', '"<s></s><pad>"'),
        ["experts.0.positive_prompts.0"],
    ),
    (
        "negative-special-only",
        lambda t: t.replace('["def main(): import os"]', '["def main(): import os"]\n    negative_prompts: ["</s>"]'),
        ["experts.0.negative_prompts.0"],
    ),
    (
        "cheap-embed-special-only",
        lambda t: t.replace("gate_mode: hidden", "gate_mode: cheap_embed").replace('"def main(): import os"', '"<s>"'),
        ["experts.0.positive_prompts.0"],
    ),
    ("chat-template-missing", lambda t: t + "chat_template: true\n", ["chat_template"]),
]


@pytest.mark.parametrize("command", ["validate", "merge-dry", "merge"])
@pytest.mark.parametrize(("case", "edit", "expected"), PROMPTS, ids=[p[0] for p in PROMPTS])
def test_prompts_that_tokenize_to_nothing(env, refused, command, case, edit, expected):
    _tokenizer_without_template(env.models["base"])
    r = env.recipe(edit(good(env)))
    refused(COMMANDS[command](env, r), ["r.yaml", *expected], inputs=[r, *env.models.values()], sandbox=env.root)


def test_prompt_longer_than_the_context(env, cli):
    r = env.recipe(good(env).replace('"def main(): import os"', '"' + "def main(): import os " * 3000 + '"'))
    res = cli(["merge", str(r), "--dry-run"])
    named = "experts.0.positive_prompts.0" in res.output
    assert (res.exit_code == 2 and named) or (res.exit_code == 0 and "truncat" in res.output and named), res.output


def test_one_expert_mixture(env, cli):
    text = good(env)
    r = env.recipe(text[: text.index("  - name: b")])
    res = cli(["merge", str(r), "--dry-run"])
    assert (res.exit_code == 2 or "warning" in res.output) and "expert" in res.output, res.output
    assert "one expert" in res.output or "1 expert" in res.output or "at least 2" in res.output, res.output


def _non_finite(d: Path, value: float) -> str:
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / ST))
    name = next(k for k in state if ".mlp.down_proj" in k)
    state[name] = torch.full_like(state[name], value)
    save_file(state, str(d / ST), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("command", ["merge", "export"])
def test_non_finite_tensor_is_refused(env, refused, command, value):
    """Checked while tensors stream (io.checkpoint.Checkpoint.get), refused naming the file and the tensor."""
    name = _non_finite(env.models["e1"], value)
    if command == "merge":
        r = env.recipe(good(env).replace("gate_mode: hidden", "gate_mode: random"))
        args = ["merge", str(r), "-o", str(env.outs / "moe")]
    else:
        r = None
        args = ["export", str(env.models["e1"]), "-o", str(env.outs / "art"), "--no-verify"]
    expected = [str(env.models["e1"] / ST), f"tensor {name!r}", "NaN and", "Inf values"]
    refused(args, expected, inputs=[*env.models.values(), *([r] if r else [])], sandbox=env.root)


def test_bad_quant_is_one_sentence(env, refused):
    res = refused(
        ["export", str(env.models["e1"]), "-o", str(env.outs / "art"), "--dry-run", "--quant", "q9_9"],
        ["q9_9"],
        inputs=list(env.models.values()),
        sandbox=env.root,
    )
    assert "pydantic" not in res.output and "http" not in res.output
