"""The pipeline: recipe → plan → assemble → train → evaluate → export → package, one function per stage.

Every stage takes the validated recipe object (:func:`load` reads a file once; a path is accepted at these entry
points for convenience and loaded here, never again further down). Stages report through a rich console
(:mod:`moetool.progress`): silent unless one is passed. ``moetool build`` and ``moetool demo`` are :func:`build`;
the CLI only parses arguments and prints.

    recipe = api.load("recipes/demo-mofe.yaml")
    merged = api.assemble(recipe, "out/merged")
    tuned = api.train(recipe, "out/tuned", model=merged).output
    manifest = api.export(tuned, "out/gguf", for_="raspberry-pi-4")
"""

from moetool.api import experts
from moetool.api.ask import AskedQuestion, ask
from moetool.api.pipeline import BuildResult, build
from moetool.api.stages import (
    RecipeLike,
    adapter_base,
    assemble,
    check,
    check_report_outputs,
    evaluate,
    export,
    load,
    nonfinite_figures,
    package,
    plan,
    plan_export,
    plugin,
    train,
    write_report,
)

__all__ = [
    "AskedQuestion",
    "BuildResult",
    "RecipeLike",
    "adapter_base",
    "ask",
    "assemble",
    "build",
    "check",
    "check_report_outputs",
    "evaluate",
    "experts",
    "export",
    "load",
    "nonfinite_figures",
    "package",
    "plan",
    "plan_export",
    "plugin",
    "train",
    "write_report",
]
