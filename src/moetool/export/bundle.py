"""A bundle artifact: a router graph, one standard artifact per member, and a manifest, written atomically.

GEM's sequence-level pathways and hybrid's experts ship this way: a small router picks a member, and each member is a
model that the standard exporters take (each with its own parity check). The router and the manifest are the
method's; the member exports, the fields every manifest has (:func:`~moetool.export.base.manifest_fields`: files and
hashes, the source's weights, the parity) and the atomic write are here, once, so ``moetool package`` takes a bundle
like any other export.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from moetool.export.base import ExportError, Manifest, manifest_fields, write_manifest
from moetool.export.parity import NOT_VERIFIED, BundleParity, ParityRecord, Refused, parity_of
from moetool.export.resolve import plan_standard_export
from moetool.extras import MissingExtraError
from moetool.io.atomic import atomic_dir
from moetool.io.jsontypes import JsonValue

# a member's own writer (hybrid's Mamba experts): (source, output folder) → its manifest
MemberWriter = Callable[[Path, Path], dict[str, Any]]


@dataclass(frozen=True)
class Member:
    """One model of the bundle: ``source`` (a model folder) is exported into ``folder`` (relative to the bundle) by
    the standard exporter for the bundle's target, or by ``writer`` when it has one."""

    name: str
    source: Path
    folder: str
    writer: MemberWriter | None = None


@dataclass(frozen=True)
class MemberArtifact:
    """What a member's export wrote (``file``, inside ``folder``; its parity), or why the target refused it."""

    name: str
    target: str
    folder: str | None = None
    file: str | None = None
    parity: ParityRecord | str | None = None
    refused: str | None = None

    @property
    def path(self) -> str:
        """The artifact's file relative to the bundle."""
        return f"{self.folder}/{self.file}"

    def to_json(self) -> dict[str, Any]:
        if self.refused is not None:
            return {"target": self.target, "exported": False, "reason": self.refused}
        parity = self.parity.to_json() if isinstance(self.parity, ParityRecord) else self.parity
        return {"target": self.target, "dir": self.folder, "file": self.file, "parity": parity}


@dataclass(frozen=True)
class Bundle:
    """How to export a bundle's members: the target and quant of every member, whether to verify, and whether a
    member the target cannot take is recorded with the reason (``tolerate``) or fails the whole bundle."""

    members: Sequence[Member]
    target: str
    quant: str | None = None
    verify: bool = True
    tolerate: bool = False


def export_member(member: Member, root: Path, bundle: Bundle, console: Console | None) -> MemberArtifact:
    """``member`` exported into ``root / member.folder``.

    Raises:
        ExportError: the target cannot take it and the bundle does not tolerate that.
        MissingExtraError: the target's extra is missing and the bundle does not tolerate that.
    """
    out = root / member.folder
    if console is not None:
        console.print(f"exporting {member.name} → {bundle.target}")
    try:
        if member.writer is not None:
            doc = member.writer(member.source, out)
        else:
            job = plan_standard_export(
                member.source, out, target=bundle.target, quant=bundle.quant, force=True, verify=bundle.verify
            )
            doc = job.run(console)
    except (ExportError, MissingExtraError) as exc:
        if not bundle.tolerate:
            raise
        return MemberArtifact(member.name, bundle.target, refused=str(exc))
    # checked outside the try: a malformed manifest is the writer's bug, never a refusal to record
    m = Manifest.of(doc, source=f"the writer of {member.name}")
    return MemberArtifact(member.name, m.target or bundle.target, member.folder, m.file, m.parity)


def bundle_parity(router: Mapping[str, JsonValue], artifacts: list[MemberArtifact], verify: bool) -> ParityRecord | str:
    """A bundle's parity: the router graph's figures (its entry's ``parity``) and each member's (or why the target
    refused it)."""
    if not verify:
        return NOT_VERIFIED
    members: dict[str, ParityRecord | Refused | str | None] = {
        a.name: a.parity if a.refused is None else Refused(a.refused) for a in artifacts
    }
    return ParityRecord(bundle=BundleParity(router=parity_of(router.get("parity")), members=members))


def export_bundle(
    output: Path,
    bundle: Bundle,
    *,
    source: Path,
    router: Callable[[Path], dict[str, Any]],
    manifest: Callable[[Path, dict[str, Any], list[MemberArtifact]], dict[str, Any]],
    force: bool = False,
    console: Console | None = None,
) -> dict[str, Any]:
    """Write a bundle into ``output`` atomically and return its manifest.

    ``router(tmp)`` writes the router graph (and what else the method ships beside it) into the temporary folder and
    returns its manifest entry (with the graph's ``file``); then every member is exported; ``manifest(tmp,
    router_entry, artifacts)`` builds the method's manifest, to which the fields every manifest has are added (the
    router graph as the main file, the members' target, ``source``'s weights, the bundle's parity), written as
    ``manifest.json``. Nothing is moved into place unless all of it succeeded.

    Raises:
        OutputExistsError: ``output`` exists and ``force`` is not given.
        ExportError: a member export failed (and the bundle does not tolerate it), or the router's own check did.
    """
    with atomic_dir(Path(output), force=force) as tmp:
        entry = router(tmp)
        artifacts = [export_member(m, tmp, bundle, console) for m in bundle.members]
        doc = manifest(tmp, entry, artifacts)
        doc |= manifest_fields(tmp, source, entry["file"], target=bundle.target, model_type=None)
        parity = bundle_parity(entry, artifacts, bundle.verify)
        doc["parity"] = parity.to_json() if isinstance(parity, ParityRecord) else parity
        write_manifest(tmp, doc)
    return doc
