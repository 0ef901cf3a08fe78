"""Quantization plans: a precision per tensor, chosen by role or glob, resolved before anything is written.

A plan spec (the recipe's ``quantization:`` section, or ``--quant``) is a preset, a default type and ordered rules;
the first rule that matches a tensor decides its type. Resolution against a model's tensors gives a
:class:`QuantPlan`: one :class:`Assignment` per tensor with the requested and the usable type, and bytes per role.
"""

from __future__ import annotations

import fnmatch
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TypedDict

from pydantic import Field, field_validator, model_validator

from moetool.errors import MoetoolError
from moetool.quant.roles import ROLES, Role, role_of
from moetool.quant.types import TYPES, fit_type, get_type
from moetool.strict import StrictModel


class UnmatchedRuleError(MoetoolError):
    """A rule of the user's plan matches no tensor of the model (a typo would otherwise go unnoticed)."""


class QuantRule(StrictModel):
    """Tensors of one role, or whose name matches a glob, get ``type``."""

    role: Role | None = Field(default=None, description=f"One of: {', '.join(ROLES)}.")
    match: str | None = Field(default=None, description="Glob over the Hugging Face or exported tensor name.")
    type: str = Field(description=f"One of: {', '.join(TYPES)}.")

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        return get_type(v).name

    @model_validator(mode="after")
    def _one(self) -> QuantRule:
        if (self.role is None) == (self.match is None):
            raise ValueError("a rule needs exactly one of 'role' or 'match'")
        return self

    def describe(self) -> str:
        """The rule as ``--quant`` writes it: ``role=type`` or ``glob=type``."""
        return f"'{self.role or self.match}={self.type}'"

    def matches(self, names: tuple[str, ...], role: Role) -> bool:
        if self.role is not None:
            return role == self.role
        assert self.match is not None
        return any(fnmatch.fnmatchcase(n, self.match) for n in names)


class QuantSpec(StrictModel):
    """The ``quantization:`` recipe section: a preset, overridden by ``default`` and ``rules``."""

    preset: str | None = Field(default=None, description="A named plan (`moetool presets`), or a type name.")
    default: str | None = Field(default=None, description="Type for tensors no rule matches.")
    rules: list[QuantRule] = Field(default_factory=list, description="Tried in order; the first match decides.")
    budget: int | None = Field(
        default=None,
        gt=0,
        description="Bytes of tensors to fit: every tensor no rule matches gets the type its measured sensitivity "
        "earns under this budget (GGUF, with an importance matrix).",
    )

    @field_validator("preset")
    @classmethod
    def _preset(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESETS and v.lower() not in TYPES:
            raise ValueError(f"unknown preset {v!r}; known: {', '.join([*PRESETS, *TYPES])}")
        return v

    @field_validator("default")
    @classmethod
    def _default(cls, v: str | None) -> str | None:
        return None if v is None else get_type(v).name

    def effective(self) -> tuple[str, list[QuantRule]]:
        """Default type and rule list after applying the preset (own rules first)."""
        base_default, base_rules = "f32", []
        if self.preset is not None:
            p = preset_spec(self.preset)
            base_default, base_rules = p.default or "f32", list(p.rules)
        return self.default or base_default, [*self.rules, *base_rules]

    def label(self) -> str:
        """A short name for file names and tables."""
        if self.budget is not None:
            return f"alloc-{self.budget / 1e6:.0f}mb"
        if self.preset and not self.rules and not self.default:
            return self.preset.lower()
        if not self.rules and self.default and not self.preset:
            return self.default
        return "custom"


def _r(role: Role, t: str) -> QuantRule:
    return QuantRule(role=role, type=t)


# Routers stay f32 in every preset except gem (llama.cpp's own converter and quantizer never touch them).
PRESETS: dict[str, QuantSpec] = {
    # GEM's role map: domain pathways 4-bit, router 6-bit, general layers 8-bit. 6-bit is Q6_K (6.56 bpw);
    # where a row is not a multiple of 256 llama.cpp's fallback applies (q4_k → q5_0, q6_k → q8_0).
    "gem": QuantSpec(default="q8_0", rules=[_r("experts", "q4_k"), _r("router", "q6_k")]),
    # 4-bit experts, 8-bit everything else: written by gguf-py alone
    "moe-q4": QuantSpec(default="q8_0", rules=[_r("router", "f32"), _r("experts", "q4_0")]),
    # the same with K types (needs llama.cpp's quantizer); attention and head at 6 bits
    "moe-q4k": QuantSpec(
        default="q8_0",
        rules=[_r("router", "f32"), _r("experts", "q4_k"), _r("attention", "q6_k"), _r("output", "q6_k")],
    ),
    # 5-bit experts, 8-bit rest
    "moe-q5": QuantSpec(default="q8_0", rules=[_r("router", "f32"), _r("experts", "q5_0")]),
}
PRESET_HELP: dict[str, str] = {
    "gem": "GEM role map: experts 4-bit (q4_k), router 6-bit (q6_k), general layers 8-bit (q8_0)",
    "moe-q4": "experts q4_0, router f32, everything else q8_0",
    "moe-q4k": "experts q4_k, attention and output q6_k, router f32, rest q8_0",
    "moe-q5": "experts q5_0, router f32, everything else q8_0",
}


def preset_spec(name: str) -> QuantSpec:
    """A preset by name; every type name is also a uniform preset (routers kept f32)."""
    if name in PRESETS:
        return PRESETS[name]
    t = get_type(name).name
    return QuantSpec(default=t, rules=[] if t == "f32" else [_r("router", "f32")])


def parse_quant(text: str) -> QuantSpec:
    """``--quant`` syntax: a preset or type (``q4_0``, ``gem``), or rules ``experts=q4_k,attention=q8_0,*=q8_0``.

    In rule form a key is a role, ``*`` or ``default`` for the default, or any other glob; ``preset=NAME`` adds a
    preset under the rules.
    """
    text = text.strip()
    if "=" not in text:
        return QuantSpec(preset=text)
    preset, default, rules, budget = None, None, [], None
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not value:
            raise ValueError(f"--quant: {part!r} has no type after '='")
        if key == "preset":
            preset = value
        elif key == "budget":
            from moetool.io.budget import parse_size

            budget = parse_size(value, what="--quant budget")
        elif key in ("*", "default"):
            default = value
        elif key in ROLES:
            rules.append({"role": key, "type": value})
        else:
            rules.append({"match": key, "type": value})
    return QuantSpec.model_validate({"preset": preset, "default": default, "rules": rules, "budget": budget})


@dataclass(frozen=True)
class TensorEntry:
    """What a plan needs to know of one tensor: names, role and torch shape."""

    hf_name: str
    shape: tuple[int, ...]
    out_name: str | None = None  # name in the exported artifact (e.g. GGUF), if different
    role: Role | None = None  # override when the HF name alone does not tell it

    @property
    def names(self) -> tuple[str, ...]:
        return (self.hf_name,) if self.out_name is None else (self.hf_name, self.out_name)


@dataclass(frozen=True)
class Assignment:
    entry: TensorEntry
    role: Role
    requested: str
    type: str
    note: str | None = None

    @property
    def nbytes(self) -> int:
        return TYPES[self.type].nbytes(self.entry.shape)

    @property
    def params(self) -> int:
        return math.prod(self.entry.shape)


class RoleUse(TypedDict):
    """One role's share of a plan (:meth:`QuantPlan.by_role`): parameters, bytes, and tensors by type."""

    params: int
    bytes: int
    types: dict[str, int]


@dataclass
class QuantPlan:
    label: str
    spec: QuantSpec
    assignments: list[Assignment] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(a.nbytes for a in self.assignments)

    @property
    def total_params(self) -> int:
        return sum(a.params for a in self.assignments)

    def by_role(self) -> dict[str, RoleUse]:
        """Per role: parameters, bytes and the types used (with counts)."""
        out: dict[str, RoleUse] = {}
        for a in self.assignments:
            row = out.setdefault(a.role, {"params": 0, "bytes": 0, "types": {}})
            row["params"] += a.params
            row["bytes"] += a.nbytes
            row["types"][a.type] = row["types"].get(a.type, 0) + 1
        return {k: out[k] for k in sorted(out, key=ROLES.index)}

    def bpw(self) -> float:
        return 8 * self.total_bytes / max(self.total_params, 1)

    def type_of(self, name: str) -> str:
        for a in self.assignments:
            if name in a.entry.names:
                return a.type
        raise KeyError(name)

    def notes(self) -> list[str]:
        """Distinct fallback notes, one line per (requested → used) pair with a count."""
        seen: dict[tuple[str, str, str], int] = defaultdict(int)
        for a in self.assignments:
            if a.note:
                why = (
                    "row length not a multiple of its block; llama.cpp's fallback" if "row length" in a.note else a.note
                )
                seen[(a.requested, a.type, why)] += 1
        return [f"{n} tensor(s): {req} → {used} ({why})" for (req, used, why), n in seen.items()]

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "spec": self.spec.model_dump(exclude_none=True),
            "total_bytes": self.total_bytes,
            "total_params": self.total_params,
            "bits_per_weight": round(self.bpw(), 4),
            "by_role": self.by_role(),
            "notes": self.notes(),
            "tensors": {
                (a.entry.out_name or a.entry.hf_name): {"role": a.role, "type": a.type, "requested": a.requested}
                for a in self.assignments
            },
        }


def resolve(
    spec: QuantSpec,
    entries: list[TensorEntry],
    *,
    keep_f32: frozenset[Role] = frozenset(),
    cannot: dict[str, str] | None = None,
    fit_rows: bool = True,
) -> QuantPlan:
    """Assign a type to every tensor.

    Args:
        spec: the plan spec.
        entries: every tensor to be written.
        keep_f32: roles the target always stores in f32 whatever the plan says.
        cannot: type → replacement for types this target cannot write for some role, keyed ``"role:type"``.
        fit_rows: apply llama.cpp's block-size fallbacks (GGUF); graph runtimes pad partial blocks instead.

    1-D tensors (norms, biases) are always f32, silently: llama.cpp and the graph runtimes keep them so, and they
    are a negligible share of the bytes.
    """
    default, rules = spec.effective()
    out = QuantPlan(label=spec.label(), spec=spec)
    cannot = cannot or {}
    unmatched = list(spec.rules)  # the user's own rules (a preset's may not apply to every model)
    for e in entries:
        role = e.role or role_of(e.hf_name)
        unmatched = [r for r in unmatched if not r.matches(e.names, role)]
        requested = next((r.type for r in rules if r.matches(e.names, role)), default)
        note = None
        if len(e.shape) < 2:
            t = "f32"
        elif role in keep_f32:
            t = "f32"
            note = None if requested == "f32" else f"{role} stays f32 in this format"
        else:
            t, note = fit_type(requested, e.shape[-1]) if fit_rows else (requested, None)
            swap = cannot.get(f"{role}:{t}")
            if swap:
                t, note = swap, f"{role} cannot be {t} in this format; using {swap}"
        out.assignments.append(Assignment(e, role, requested, t, note))
    if unmatched and entries:
        sample = ", ".join(sorted({e.out_name or e.hf_name for e in entries})[:3])
        roles = ", ".join(sorted({a.role for a in out.assignments}))
        raise UnmatchedRuleError(
            f"quantization rule {unmatched[0].describe()} matches no tensor of this model (its roles: {roles}; "
            f"names look like {sample}, …); fix or remove it"
        )
    return out
