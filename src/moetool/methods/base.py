"""The method plugin protocol: what every merge method provides to the pipeline (:mod:`moetool.api`).

A method is one folder under ``moetool/methods/`` whose ``__init__`` exposes ``PLUGIN`` (a :class:`MethodPlugin`),
plus its recipe model in :mod:`moetool.recipe`; registering it is one line in :data:`moetool.registry.METHODS`.

Stages take the validated recipe object (:class:`moetool.recipe.base.RecipeBase`), never a path to parse again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from rich.console import Console

from moetool.errors import MoetoolError, RecipeError
from moetool.export.base import Exporter, ExportError, ExportRequest
from moetool.io.jsontypes import JsonObject
from moetool.io.safe import read_json
from moetool.recipe.base import RecipeBase

if TYPE_CHECKING:  # torch and transformers are slow to import; the CLI imports this module at start-up
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

# what ``api.build`` reports after each stage: (stage name, its result)
Stage = Callable[[str, object], None]

RecipeT = TypeVar("RecipeT", bound=RecipeBase)  # a method's recipe model
PlanT = TypeVar("PlanT")  # what a method's ``describe`` returns (mofe: MergePlan; the others: a MethodPlan)
RecipeT_contra = TypeVar("RecipeT_contra", bound=RecipeBase, contravariant=True)


def register_causal_lm(config_cls: type[PretrainedConfig], model_cls: type[PreTrainedModel]) -> None:
    """Let ``AutoConfig`` / ``AutoModelForCausalLM`` load checkpoints of ``config_cls.model_type`` (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


class DenseMLP(Protocol):
    """A llama-family dense MLP, ``down(act(gate(x)) * up(x))``: what a method reads of a base model's MLP."""

    gate_proj: torch.nn.Linear
    up_proj: torch.nn.Linear
    down_proj: torch.nn.Linear
    act_fn: Callable[[torch.Tensor], torch.Tensor]


# why a method's export reads no such key of a ``targets:`` entry (:meth:`MethodPlugin.check_targets`)
_UNREAD = {
    "for": "deployment profiles pick a standard MoE's format and plan",
    "context": "it sizes a standard export's memory estimate",
    "imatrix": "importance matrices are for a standard MoE's GGUF",
    "quant": "this export is written in float32 only",
}


@dataclass(frozen=True)
class MethodPlan:
    """What a research method's ``moetool merge`` will build (``--dry-run``), as data.

    Attributes:
        method: the recipe's ``method:``.
        name: the recipe's ``name:``.
        inputs: each model the merge reads, by its role in the method (``base``, ``pathway code``, ``expert a``),
            as the recipe names it.
        parameters: parameter counts the method reports (``router``, ``per expert``, ``routed embedding``).
        lines: the description, one labelled line each, as the dry run prints it.
        warnings: what the user should know before running it.
    """

    method: str
    name: str
    inputs: dict[str, str] = field(default_factory=dict)
    parameters: dict[str, int] = field(default_factory=dict)
    lines: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def render(self) -> str:
        """The dry run's text: the description lines, then one ``warning:`` line per warning."""
        return "\n".join([*self.lines, *(f"warning: {w}" for w in self.warnings)])

    def to_json(self) -> JsonObject:
        return {
            "method": self.method,
            "name": self.name,
            "inputs": dict(self.inputs),
            "parameters": dict(self.parameters),
            "lines": list(self.lines),
            "warnings": list(self.warnings),
        }


@dataclass
class MethodExportPlan:
    """The plan of a method's own exporter: what it will write (printed before writing), nothing to resolve."""

    name: str
    target: str
    description: str


ExportFn = Callable[[ExportRequest, Console], JsonObject]  # a method's export: (request, console) → manifest
# a method's export to a target of its choosing: (request, target, console) → manifest
TargetExportFn = Callable[[ExportRequest, str, Console], JsonObject]


@dataclass
class FunctionExporter:
    """An :class:`~moetool.export.base.Exporter` over a method's export function ``fn(req, console) -> manifest``."""

    name: str
    requires: str
    description: str
    fn: ExportFn
    default_quant: str = "f16"  # unused: a method's export function decides its own precision

    def plan(self, req: ExportRequest) -> MethodExportPlan:
        return MethodExportPlan(name=req.model_dir.name, target=self.name, description=self.description)

    def export(self, req: ExportRequest, plan: MethodExportPlan, console: Console | None = None) -> JsonObject:
        from moetool.progress import silent

        return self.fn(req, console if console is not None else silent())


@dataclass(frozen=True)
class TrainOptions:
    """How to run a method's training: replace an existing output, resume a checkpoint, the mofe freeze preset,
    and method-specific settings (comigs: ``variant``, ``rounds``)."""

    force: bool = False
    resume: bool = True
    preset: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MergeOptions:
    """How to run a method's merge (:meth:`MethodPlugin.assemble`'s keywords): replace an existing output, allow
    pickled checkpoints, where to print, and the device a merge that runs a model uses (None: auto)."""

    force: bool
    allow_pickle: bool
    console: Console
    device: str | None


@dataclass
class TrainOutcome:
    """What a method's training wrote: the output and labelled figures for the CLI to print."""

    output: Path
    figures: dict[str, str] = field(default_factory=dict)
    detail: object = None


def config_model_type(model_dir: Path) -> str | None:
    """``model_type`` from ``model_dir/config.json``, or None when there is none."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    value = read_json(cfg, what="model config").get("model_type")
    return value if isinstance(value, str) else None


class MethodPlugin(Generic[RecipeT, PlanT]):
    """Base of every method plugin, generic over its recipe model ``RecipeT`` and its plan ``PlanT`` (what
    :meth:`describe` returns), so each stage's ``recipe`` is typed without runtime casts. A method overrides what
    it supports; the rest refuses with the reason.

    Attributes:
        name: the recipe's ``method:`` value.
        model_types: ``config.json`` ``model_type`` values of the models this method writes (its own classes).
        model_modules: modules whose import registers those classes with transformers' Auto classes.
        marker_files: files that mark an output folder as this method's (a bundle without one config.json).
        export_targets: ``moetool export --target`` values this method's outputs support (first = default).
    """

    name: str = ""
    model_types: tuple[str, ...] = ()
    model_modules: tuple[str, ...] = ()
    marker_files: tuple[str, ...] = ()
    export_targets: tuple[str, ...] = ()

    def check(self, recipe: RecipeT) -> list[str]:
        """What can be checked without weights beyond the recipe's own validation (``moetool validate``, and the
        start of every plan): raises a MoetoolError naming file and field; returns warnings."""
        return []

    def describe(self, recipe: RecipeT, *, allow_pickle: bool = False) -> PlanT:
        """What :meth:`assemble` would build (``moetool merge --dry-run``); reads no weights.

        Raises:
            NotImplementedError: the method has no merge stage.
        """
        raise NotImplementedError

    def assemble(
        self,
        recipe: RecipeT,
        output: Path,
        *,
        force: bool = False,
        allow_pickle: bool = False,
        console: Console,
        device: str | None = None,
    ) -> Path:
        """Build the model into ``output`` atomically (refusing an existing one without ``force``); returns it.

        ``device``: where the merge runs a model, if it does (mofe's hidden-state routers); None or ``auto``: a GPU
        when there is one. A method implements :meth:`merge`, which gets these options as one :class:`MergeOptions`.

        Raises:
            NotImplementedError: the method has no merge stage.
        """
        return self.merge(recipe, output, MergeOptions(force, allow_pickle, console, device))

    def merge(self, recipe: RecipeT, output: Path, options: MergeOptions) -> Path:
        """:meth:`assemble`'s work, which each method with a merge stage provides.

        Raises:
            NotImplementedError: the method has no merge stage.
        """
        raise NotImplementedError

    def refuse_device(self, device: str | None) -> None:
        """Refuse ``--device`` for a method whose merge does not take one (rather than ignore it).

        Raises:
            MoetoolError: a device other than auto was asked for.
        """
        if device not in (None, "auto"):
            raise MoetoolError(f"--device: method {self.name}'s merge runs on the CPU and takes no --device")

    def train(
        self, recipe: RecipeT, model: Path | None, output: Path, options: TrainOptions, console: Console
    ) -> TrainOutcome:
        """Train what the recipe's training section says, from ``model`` (the merged output) into ``output``.

        Raises:
            MoetoolError: the method has nothing to train after the merge.
        """
        raise MoetoolError(
            f"method {self.name}: its routers are trained inside `moetool merge` (see docs/{self.name}.md); "
            "`moetool train` has nothing more to do"
        )

    def target_keys(self, recipe: RecipeT) -> dict[str, tuple[str, ...]]:
        """The targets this recipe's output exports to (what its ``targets:`` entries may name), each with the keys
        of a ``targets:`` entry its exporter reads besides ``target`` and ``name``.

        Default: every :attr:`export_targets` entry, reading ``quant`` (a bundle hands it to the standard exporters
        of its members). A method whose targets depend on the recipe (GEM's level) or that ignores ``quant``
        overrides this.
        """
        return {t: ("quant",) for t in self.export_targets}

    def target_note(self, recipe: RecipeT) -> str:
        """What decides this recipe's targets, for the refusal's message (GEM: `` (level: token)``); default none."""
        return ""

    def check_targets(self, recipe: RecipeT) -> None:
        """Refuse, before any work, a ``targets:`` entry this method's output cannot be exported as asked: a target
        it cannot write, a deployment profile (``for:`` picks a standard MoE's format and plan), or a key its exporter
        would not read (``context``, ``imatrix``, a ``quant`` for an export that is float32 only).

        Raises:
            RecipeError: naming the recipe, the entry's field, the method, the target and the targets it writes.
        """
        keys = self.target_keys(recipe)
        supported = ", ".join(keys) or "none"
        for i, t in enumerate(getattr(recipe, "targets", None) or []):
            where = f"{recipe.path or recipe.name}: targets.{i}"
            if t.target is None:
                raise RecipeError(
                    f"{where}.for: method {self.name}'s outputs export by target, not for a deployment profile (a "
                    f"profile picks a standard MoE's format and plan); name a target: {supported}"
                )
            if t.target not in keys:
                raise RecipeError(
                    f"{where}.target: method {self.name}{self.target_note(recipe)} cannot write target {t.target!r}; "
                    f"the targets it writes: {supported}"
                )
            given = {"for": t.for_, "context": t.context, "imatrix": t.imatrix, "quant": t.quant}
            for key, value in given.items():
                if value is not None and key not in keys[t.target]:
                    raise RecipeError(
                        f"{where}.{key}: method {self.name}'s {t.target} export does not read {key} "
                        f"({_UNREAD[key]}); remove it"
                    )

    def owns(self, model_dir: Path) -> bool:
        """Whether ``model_dir`` is an output of this method (its model class or its bundle marker)."""
        if any((model_dir / m).is_file() for m in self.marker_files):
            return True
        return bool(self.model_types) and config_model_type(model_dir) in self.model_types

    def exporter(self, model_dir: Path, target: str | None) -> Exporter[MethodExportPlan]:
        """The exporter of this method's output ``model_dir`` for ``target`` (None: the method's default)."""
        if not self.export_targets:
            raise ExportError(f"{model_dir} is a {self.name} model, which has no exporter")
        raise self.refuse_target(model_dir, target)

    def refuse_target(self, model_dir: Path, target: str | None) -> ExportError:
        return ExportError(
            f"{model_dir} is a {self.name} model: --target {target!r} is not supported "
            f"(supported: {', '.join(self.export_targets)})"
        )

    def function_exporter(
        self, model_dir: Path, target: str | None, fn: TargetExportFn, describe: Callable[[str], str]
    ) -> FunctionExporter:
        """``target`` (default: the first of :attr:`export_targets`) checked, then ``fn(req, target, console)`` as
        its exporter."""
        chosen = target or self.export_targets[0]
        if chosen not in self.export_targets:
            raise self.refuse_target(model_dir, chosen)
        return FunctionExporter(
            name=chosen, requires=chosen, description=describe(chosen), fn=lambda req, console: fn(req, chosen, console)
        )


class Assembler(Protocol[RecipeT_contra]):
    """What an :class:`AssemblerPlugin` names: describe and build a method's model from its recipe."""

    def describe(self, recipe: RecipeT_contra, *, recipe_dir: Path) -> MethodPlan: ...

    def assemble(
        self, recipe: RecipeT_contra, *, recipe_dir: Path, output: Path, force: bool = False, console: Console | None
    ) -> Path: ...


class AssemblerPlugin(MethodPlugin[RecipeT, MethodPlan]):
    """A method whose ``moetool merge`` is an :class:`Assembler` object, named by :attr:`assembler` (imported on
    first use), and whose plan is the assembler's :class:`MethodPlan`."""

    assembler: str = ""  # "module:Class"

    def _assembler(self) -> Assembler[RecipeT]:
        from moetool import registry

        built: Assembler[RecipeT] = registry.load(self.assembler)()
        return built

    def describe(self, recipe: RecipeT, *, allow_pickle: bool = False) -> MethodPlan:
        return self._assembler().describe(recipe, recipe_dir=recipe.recipe_dir)

    def merge(self, recipe: RecipeT, output: Path, options: MergeOptions) -> Path:
        self.refuse_device(options.device)
        built = self._assembler().assemble(
            recipe, recipe_dir=recipe.recipe_dir, output=output, force=options.force, console=options.console
        )
        return Path(built)
