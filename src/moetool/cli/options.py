"""One meaning per option name across every command: the table each command's options are checked against.

``--device`` is always the torch device a command computes on (``auto``, ``cpu``, ``cuda:N``); the deployment
profile an artifact is made for (``moetool profiles``: ``raspberry-pi-4``, ``iphone-13``) is ``--for``, and ``for:``
in a recipe's ``targets:``. A new option takes a name from :data:`MEANINGS` only in that name's meaning, or adds a
row; ``tests/cli/test_option_names.py`` walks every command and fails on an option the table does not declare, on
one whose kind (a flag, one value, repeated values) differs from its row, and on a help text that leaves out its
row's value set (where a row names one).

One meaning has one name too: no two rows share a meaning (the test checks that as well). An old spelling kept for
one release is a hidden option listed in :data:`RENAMED`; :func:`old_spelling` reads it and warns with the new
spelling.

Checks every option shares are installed once, by the root group (:class:`CheckedGroup`), not by each command: an
empty (or blank) string or path is refused by name (:func:`check_tree`), and the old ``--json FILE`` of the commands
in :data:`JSON_FILE_BEFORE` is read as ``--output FILE`` (:func:`old_json_file`).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, TypeVar

import typer
from typer.core import TyperGroup

from moetool import registry
from moetool.cli.console import fail, show_deprecations
from moetool.errors import MoetoolError, deprecated

if TYPE_CHECKING:  # typer's own copy of click: its classes, for the annotations only
    from typer._click.core import Command, Context, Parameter, ParameterSource

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
PROFILES = "`moetool profiles`"  # --for's value set: the deployment profiles
TARGETS = ", ".join(registry.TARGETS)  # --target's value set: the exporter registry's, so the help cannot drift
VERIFY = "check the result (an artifact in its runtime, an edit against its input); --no-verify skips it"

MEANINGS: dict[str, Meaning] = {
    "--device": Meaning("the torch device the command computes on", values=TORCH_DEVICE),
    "--for": Meaning("the deployment device an artifact or a latency profile is for", values=PROFILES),
    "--output": Meaning("where the command writes (a folder, or the file it names)"),
    "-o": Meaning("short for --output"),
    "--force": Meaning("replace (or rebuild) what already exists", "flag"),
    "--dry-run": Meaning("print what would be done; write and contact nothing", "flag"),
    "--verify": Meaning(VERIFY, "flag"),
    # a flag everywhere; a report written to a file is --output FILE (eval, experts list, gem eval)
    "--json": Meaning("print the result as JSON on stdout (instead of tables)", "flag"),
    "--dtype": Meaning("the dtype weights are held in (auto: the checkpoint's own)"),
    "--data": Meaning("text per domain, NAME=FILE (repeatable)", "values"),
    "--max-tokens": Meaning("held-out or calibration tokens per domain text"),
    "--seq-len": Meaning("window length in tokens"),
    "--target": Meaning("the export format", values=TARGETS),
    "--quant": Meaning("the precision plan: a preset, a type or rules by role (`moetool presets`)"),
    "--profile": Meaning("the zoo profile (default, tiny, smollm2)"),
    "--from": Meaning("a local file to read instead of measuring or fetching"),
    "--base": Meaning("the dense base model of a LoRA adapter"),
    "--eval-text": Meaning("held-out text file for the artifact's parity check"),
    "--plots": Meaning("a folder of PNG plots"),
    "--tasks": Meaning("lm-evaluation-harness tasks, comma-separated"),
    "--task-limit": Meaning("documents per lm-eval task"),
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
    "--eval": Meaning("a `moetool eval -o` report to package"),
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
    ("eval", "--limit"): "--task-limit",
    **{(f"experts {c}", "--no-check"): "--no-verify" for c in ("add", "remove", "prune", "extract")},
}
# why each old spelling went, by the old option
WHY = {
    "--device": "--device names the torch device on every other command",
    "--limit": "one name for documents per lm-eval task, as on `moetool build`",
    "--no-check": "one name for skipping the check, as on `moetool export`",
}
# commands whose --json took a FILE before --json became a flag everywhere: that FILE is now --output's
JSON_FILE_BEFORE = ("eval", "experts list", "gem eval")
# a torch device name (what --device takes on every other command), never a deployment profile
_TORCH_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")

T = TypeVar("T")

ForOpt = Annotated[
    str | None,
    typer.Option(
        "--for",
        help=f"Deployment profile ({PROFILES}: raspberry-pi-4, iphone-13, …): picks the format and the best plan "
        "that fits its memory.",
    ),
]
VerifyOpt = Annotated[
    bool,
    typer.Option(
        "--verify/--no-verify",
        help="Check the result: an export's artifact in its runtime against transformers, an edited MoE against its "
        "input (--no-verify skips it: large models).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout, instead of the tables.")]
OldDeviceOpt = Annotated[
    str | None, typer.Option("--device", hidden=True, help="The old spelling of --for (read in this release only).")
]


def old_spelling(command: str, old: str, old_value: T | None, new_value: T | None) -> T | None:
    """The option's value, read from its old spelling ``old`` when that was given (with a deprecation warning naming
    the new one, :data:`RENAMED`). A flag's old spelling is given as ``True`` (``None``: not given).

    Raises:
        MoetoolError: both spellings were given; ``--device`` given a torch device where it is the old ``--for``.
    """
    if old_value is None:
        return new_value
    new = RENAMED[(command, old)]
    if new == "--for" and isinstance(old_value, str) and _TORCH_DEVICE.fullmatch(old_value.strip()):
        raise MoetoolError(
            f"`moetool {command} {old} {old_value}`: {old_value} is a torch device, and `moetool {command}` has no "
            f"{old}: {command_device(command)}. Leave {old} out; --for takes a deployment profile ({PROFILES}: "
            "raspberry-pi-4, iphone-13, …), not a torch device"
        )
    if new_value is not None:
        raise MoetoolError(f"{old} is the old spelling of {new}, which is also given; keep only {new}")
    given = "" if isinstance(old_value, bool) else f" {old_value}"
    deprecated(
        f"`moetool {command} {old}{given}` is the old spelling: write `{new}{given}` ({WHY[old]}; {old} here is read "
        "in this release, not in the next)"
    )
    return old_value


def command_device(command: str) -> str:
    """Where ``command`` (one whose ``--device`` is the old ``--for``) computes, in the words of its refusal."""
    if command == "export":
        return (
            "the conversion and the parity check run on the CPU, in the target's own converter and runtime "
            "(--imatrix auto collects on a GPU when there is one)"
        )
    return "the latency is measured on this machine's CPU (or in llama.cpp, with --gguf)"


class CheckedGroup(TyperGroup):
    """The root group, ``moetool``: every command it resolves gets the checks all options share (:func:`check_tree`),
    and its arguments are read with the old ``--json FILE`` rewritten (:func:`old_json_file`)."""

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            check_tree(command)
        return command

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        show_deprecations()  # before the root's callback (which installs it too): old_json_file may warn
        return super().parse_args(ctx, old_json_file(self, args))


_CHECKED: weakref.WeakSet[Command] = weakref.WeakSet()


def check_tree(command: Command) -> None:
    """Refuse an empty or blank value given to any option or argument of ``command`` (and of its subcommands), by
    name: ``--device ""`` (an unset shell variable) is a mistake, never the option's default. Read as given, before
    typer converts it (``Path("")`` is ``.``)."""
    if command in _CHECKED:
        return
    _CHECKED.add(command)  # once per command object (typer builds them anew per app call)
    for param in command.params:
        # on the instance: typer picks the parameter classes, and consume_value is where the value is still raw
        param.consume_value = _refusing_empty(param, param.consume_value)  # type: ignore[method-assign,assignment]
    for sub in getattr(command, "commands", {}).values():
        check_tree(sub)


Consume = Callable[["Context", Mapping[str, object]], tuple[object, "ParameterSource"]]


def _refusing_empty(param: Parameter, consume: Consume) -> Consume:
    """``param``'s ``consume_value`` (the value as given, and where from) after the empty-value check."""

    def checked(ctx: Context, opts: Mapping[str, object]) -> tuple[object, ParameterSource]:
        value, source = consume(ctx, opts)
        values = value if isinstance(value, tuple | list) else (value,)
        given = source.name in ("COMMANDLINE", "ENVIRONMENT")
        if given and any(isinstance(v, str) and not v.strip() for v in values):
            if param.param_type_name == "option":
                fail(f"{max(param.opts, key=len)} is empty: give a value, or leave the option out")
            fail(f"{(param.name or '').upper()} is empty: give a value")
        return value, source

    return checked


def old_json_file(root: TyperGroup, args: list[str]) -> list[str]:
    """``args`` with the old ``--json FILE`` of a command in :data:`JSON_FILE_BEFORE` read as ``--output FILE`` (with
    a deprecation warning). FILE is the next word when it is not an option, a ``zoo:`` model or a folder (a model)."""
    command: Command = root
    path: list[str] = []
    for word in args:
        subs = getattr(command, "commands", None)
        if subs is None or word not in subs:
            if word.startswith("-") and subs is not None:
                continue  # the root's own options (-v)
            break
        command = subs[word]
        path.append(word)
    if " ".join(path) not in JSON_FILE_BEFORE:
        return args
    read: list[str] = []
    i = 0
    while i < len(args):
        name, eq, file = args[i].partition("=")
        following = args[i + 1] if i + 1 < len(args) else ""
        if name == "--json" and not eq and _a_file(following):
            file, i = following, i + 1
        elif name != "--json" or not eq:
            read.append(args[i])
            i += 1
            continue
        read.append(f"--output={file}")
        i += 1
        deprecated(
            f"`moetool {' '.join(path)} --json {file}` is the old spelling: write `-o {file}` (--json is a flag on "
            "every command: it prints the result as JSON on stdout)"
        )
    return read


def _a_file(word: str) -> bool:
    """Whether the word after ``--json`` is the old FILE: not an option, a ``zoo:`` model or a folder (a model)."""
    return bool(word) and not word.startswith(("-", "zoo:")) and not Path(word).is_dir()
