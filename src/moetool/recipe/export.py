"""The ``targets:`` recipe section: what ``moetool build`` exports, for a deployment profile (``for:``) or by target."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from moetool.quant.devices import get_device
from moetool.quant.plan import parse_quant
from moetool.recipe.base import ForSection

Target = Literal["gguf", "onnx", "tflite", "coreml", "executorch", "mlx"]


class TargetSpec(ForSection):
    """One artifact: for a deployment profile (its preferred available format and a plan that fits), a target, or
    both. The profile's key is ``for:`` (``--for`` on the command line); ``device:`` is its old spelling."""

    section = "targets"

    for_: str | None = Field(
        default=None, alias="for", description="A deployment profile (`moetool profiles`), as `moetool export --for`."
    )
    target: Target | None = Field(
        default=None, description="Format, with `for` one the profile runs; default: the profile's first available one."
    )
    quant: str | None = Field(default=None, description="--quant syntax; default: the recipe's quantization section.")
    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Directory under exports/ (default: the profile and/or the target).",
    )
    context: int | None = Field(default=None, ge=16, description="Context length for the memory estimate.")
    imatrix: str | None = Field(
        default=None,
        description="GGUF: 'auto' collects an importance matrix on the recipe's domain data (every expert gets "
        "tokens) for llama.cpp's quantizer, or a GGUF imatrix file; needed by q2_k, q3_k and the IQ types.",
    )

    @field_validator("for_", "quant")
    @classmethod
    def _known(cls, v: str | None, info: ValidationInfo) -> str | None:
        """A deployment profile that exists, a --quant that parses (each refused in its checker's words)."""
        if v is not None:
            (get_device if info.field_name == "for_" else parse_quant)(v)
        return v

    @model_validator(mode="after")
    def _some(self) -> TargetSpec:
        if self.for_ is None and self.target is None:
            raise ValueError("a target entry needs `for` (a deployment profile), a target, or both")
        if self.for_ is not None and self.target is not None:
            # the fact export.resolve.resolve_target refuses by at export time: checked here, so `moetool validate`
            # says it and `moetool build` stops before the merge and tuning instead of after them
            profile = get_device(self.for_)
            why = profile.not_run(self.target)
            if why is not None:
                raise ValueError(
                    f"target: {why}; give one of those, leave `target` out (the profile's first, "
                    f"{profile.formats[0]}), or choose another profile (`moetool profiles`)"
                )
        return self

    @property
    def dir_name(self) -> str:
        return self.name or "-".join(x for x in (self.for_, self.target) if x)


def check_target_names(targets: list[TargetSpec]) -> None:
    """Refuse two ``targets:`` entries that would export into one folder (``exports/<name>``): the second would fail
    only after the first was written.

    Raises:
        ValueError: naming the second entry, as a recipe validator reports it.
    """
    names = [t.dir_name for t in targets]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise ValueError(f"targets.{i}: a second target named {n!r}; give it a distinct `name`")
