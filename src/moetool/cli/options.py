"""One meaning per option name across every command: the table each command's options are checked against.

``--device`` is always the torch device a command computes on (``auto``, ``cpu``, ``cuda:N``); the deployment
profile an artifact is made for (``moetool devices``: ``raspberry-pi-4``, ``iphone-13``) is ``--for``, and ``for:``
in a recipe's ``targets:``. A new option takes a name from :data:`MEANINGS` only in that name's meaning, or adds a
row; ``tests/cli/test_option_names.py`` walks every command and fails on an option the table does not declare, on
one whose kind (a flag, one value, repeated values) differs from its row, and on a help text that leaves out its
row's value set (where a row names one).

An old spelling kept for one release is a hidden option listed in :data:`RENAMED`; :func:`old_spelling` reads it and
warns with the new spelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import typer

from moetool.errors import MoetoolError, deprecated

Kind = Literal["flag", "value", "values"]  # an on/off switch, one value, a repeatable value


@dataclass(frozen=True)
class Meaning:
    """What an option name means on every command that has it.

    Attributes:
        what: the one meaning.
        kind: ``flag``, ``value`` or ``values`` (repeatable); a tuple where one meaning has two forms (``--json``).
        values: words every help text of the option contains: its value set, where a name could drift to another.
    """

    what: str
    kind: Kind | tuple[Kind, ...] = "value"
    values: str = ""

    @property
    def kinds(self) -> tuple[Kind, ...]:
        return self.kind if isinstance(self.kind, tuple) else (self.kind,)


TORCH_DEVICE = "auto (a GPU when there is one), cpu, cuda"  # --device's value set, in every help text
PROFILES = "`moetool devices`"  # --for's value set: the deployment profiles

MEANINGS: dict[str, Meaning] = {
    "--device": Meaning("the torch device the command computes on", values=TORCH_DEVICE),
    "--for": Meaning("the deployment device an artifact or a latency profile is for", values=PROFILES),
    "--output": Meaning("where the command writes (a folder, or the file it names)"),
    "-o": Meaning("short for --output"),
    "--force": Meaning("replace (or rebuild) what already exists", "flag"),
    "--dry-run": Meaning("print what would be done; write and contact nothing", "flag"),
    "--verify": Meaning("check the artifact in its runtime (--no-verify skips it)", "flag"),
    # inspect and devices print JSON (a flag); eval, experts list and gem eval write it to FILE beside their tables
    "--json": Meaning("the result as JSON: printed (a flag) or written to FILE", ("flag", "value")),
    "--dtype": Meaning("the dtype weights are held in (auto: the checkpoint's own)"),
    "--data": Meaning("text per domain, NAME=FILE (repeatable)", "values"),
    "--max-tokens": Meaning("held-out or calibration tokens per domain text"),
    "--seq-len": Meaning("window length in tokens"),
    "--target": Meaning("the export format (gguf, onnx, tflite, coreml, executorch)"),
    "--quant": Meaning("the precision plan: a preset, a type or rules by role (`moetool presets`)"),
    "--profile": Meaning("the zoo profile (default, tiny, smollm2)"),
    "--from": Meaning("a local file to read instead of measuring or fetching"),
    "--base": Meaning("the dense base model of a LoRA adapter"),
    "--eval-text": Meaning("held-out text file for the artifact's parity check"),
    "--plots": Meaning("a folder of PNG plots"),
    "--tasks": Meaning("lm-evaluation-harness tasks, comma-separated"),
    "--task-limit": Meaning("documents per lm-eval task"),
    "--limit": Meaning("documents per lm-eval task"),
    "--train": Meaning("run the training stage (--no-train skips it)", "flag"),
    "--model": Meaning("the merged model to train"),
    "--preset": Meaning("mofe's freeze preset"),
    "--no-resume": Meaning("ignore an interrupted run's checkpoint", "flag"),
    "--allow-pickle": Meaning("accept pickle checkpoints", "flag"),
    "--domains": Meaning("the domains to evaluate, comma-separated"),
    "--own": Meaning("a model's own domain, MODEL=DOMAIN (repeatable)", "values"),
    "--num-fewshot": Meaning("few-shot examples per prompt"),
    "--context": Meaning("context length for the memory estimate"),
    "--compute-units": Meaning("Core ML's compute units"),
    "--chunk-layers": Meaning("decoder layers per Core ML package, ExecuTorch program or TFLite model"),
    "--jobs": Meaning("chunks converted at once, each in a process of its own"),
    "--moe-kernel": Meaning("ONNX's MoE operators: sparse or dense"),
    "--accuracy-level": Meaning("ONNX's 4- and 8-bit operators: int8 (4) or fp32 (0) activations"),
    "--imatrix": Meaning("an importance matrix for llama.cpp's quantizer: auto or a FILE"),
    "--calibration": Meaning("calibration text for --imatrix auto"),
    "--imatrix-mode": Meaning("--imatrix auto: routed or all"),
    "--imatrix-floor": Meaning("--imatrix auto: fewest tokens per expert"),
    "--artifact": Meaning("an export folder to package (repeatable)", "values"),
    "--eval": Meaning("a `moetool eval --json` report to package"),
    "--repo-id": Meaning("the Hub repository, namespace/name"),
    "--revision": Meaning("the Hub branch"),
    "--endpoint": Meaning("the Hub URL"),
    "--message": Meaning("the commit message"),
    "-m": Meaning("short for --message"),
    "--private": Meaning("create the Hub repository private", "flag"),
    "--recipe": Meaning("a recipe file"),
    "--base-only": Meaning("smollm2 zoo: the base only", "flag"),
    "--expert-steps": Meaning("smollm2 zoo: training steps per expert"),
    "--expert-train": Meaning("smollm2 zoo: what the experts train"),
    "--by": Meaning("how experts are scored for pruning"),
    "--keep": Meaning("experts kept per layer, or a fraction"),
    "--per-layer": Meaning("each layer keeps its own best experts", "flag"),
    "--power-of-two": Meaning("round the expert budget down to a power of two", "flag"),
    "--seed": Meaning("the random seed"),
    "--top-k": Meaning("the new experts-per-token"),
    "--no-check": Meaning("skip the parity check against the input", "flag"),
    "--router-lr": Meaning("the routers' recalibration learning rate"),
    "--tune-steps": Meaning("router recalibration steps after an edit"),
    "--name": Meaning("the new expert's name"),
    "--source": Meaning("the new expert's model"),
    "--prompt": Meaning("text the new expert should receive (repeatable)", "values"),
    "--negative-prompt": Meaning("text the new expert should not receive (repeatable)", "values"),
    "--chat-template": Meaning("prompts through the tokenizer's chat template", "flag"),
    "--base-model": Meaning("base_model_name_or_path written into each adapter"),
    "--engine": Meaning("CoMiGS's training engine: inprocess or flower"),
    "--variant": Meaning("CoMiGS's variant or baseline"),
    "--rounds": Meaning("federated rounds"),
    "--eval-tokens": Meaning("held-out tokens per domain and split"),
    "--lrs": Meaning("learning rates swept, comma-separated"),
    "--steps": Meaning("training steps per arm and learning rate"),
    "--text": Meaning("text to route"),
    "--tau": Meaning("GEM's routing threshold"),
    "--log": Meaning("a JSON-lines file of routing decisions"),
    "--gguf": Meaning("a hybrid export folder whose GGUF experts are timed"),
    "--lengths": Meaning("request lengths in tokens, comma-separated"),
    "--repeats": Meaning("timed runs per length"),
    "--threads": Meaning("threads while measuring"),
    "--clock": Meaning("the clock timings read: cpu or wall"),
    "--parameter": Meaning("the hybrid loss parameter swept"),
    "--values": Meaning("the values swept, comma-separated"),
    "--timed-requests": Meaning("held-out requests timed per sweep point"),
}

# old spellings read for one release: (command, old option) -> the new option; each is a hidden option
RENAMED: dict[tuple[str, str], str] = {
    ("export", "--device"): "--for",
    ("profile", "--device"): "--for",
}

T = TypeVar("T")

ForOpt = Annotated[
    str | None,
    typer.Option(
        "--for",
        help=f"Deployment profile ({PROFILES}: raspberry-pi-4, iphone-13, …): picks the format and the best plan "
        "that fits its memory.",
    ),
]
OldDeviceOpt = Annotated[
    str | None, typer.Option("--device", hidden=True, help="The old spelling of --for (read in this release only).")
]


def old_spelling(command: str, old: str, old_value: T | None, new_value: T | None) -> T | None:
    """The option's value, read from its old spelling ``old`` when that was given (with a deprecation warning naming
    the new one, :data:`RENAMED`).

    Raises:
        MoetoolError: both spellings were given.
    """
    if old_value is None:
        return new_value
    new = RENAMED[(command, old)]
    if new_value is not None:
        raise MoetoolError(f"{old} is the old spelling of {new}, which is also given; keep only {new}")
    deprecated(
        f"`moetool {command} {old} {old_value}` is the old spelling: write `{new} {old_value}` ({old} names the torch "
        f"device on every other command; {old} here is read in this release, not in the next)"
    )
    return old_value
