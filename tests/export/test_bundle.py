"""The shared bundle export: a router, one standard artifact per member, a manifest with the fields every export's
has (files and hashes, the source's weights, the parity; what packaging reads); all of it or nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moetool.export.base import NOT_VERIFIED, ExportError, read_manifest
from moetool.export.bundle import Bundle, Member, MemberArtifact, export_bundle
from moetool.io.hashes import sha256_file


def _router(tmp: Path) -> dict[str, Any]:
    (tmp / "router.bin").write_bytes(b"router")
    return {"file": "router.bin"}


def _manifest(tmp: Path, router: dict[str, Any], artifacts: list[MemberArtifact]) -> dict[str, Any]:
    return {"format": "test-bundle/1", "router": router, "members": {a.name: a.to_json() for a in artifacts}}


def test_members_are_exported_beside_the_router(tiny_models, tmp_path):
    models = tiny_models("llama")
    members = [Member(n, models[n], f"members/{n}") for n in ("e1", "e2")]
    out = tmp_path / "bundle"
    doc = export_bundle(
        out, Bundle(members, "gguf", "f32", verify=False), source=models["base"], router=_router, manifest=_manifest
    )
    assert read_manifest(out) == doc and doc["format"] == "test-bundle/1"
    assert (out / "router.bin").read_bytes() == b"router"
    # what packaging reads: the router graph as the main file, every file with its hash, the source's weights
    assert (doc["target"], doc["file"], doc["parity"]) == ("gguf", "router.bin", NOT_VERIFIED)
    listed = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(doc["files"]) == listed and doc["artifact"]["sha256"] == sha256_file(out / "router.bin")
    assert doc["model"]["weights_sha256"] == {"model.safetensors": sha256_file(models["base"] / "model.safetensors")}
    for n in ("e1", "e2"):
        entry = doc["members"][n]
        assert entry["target"] == "gguf" and entry["dir"] == f"members/{n}"
        assert (out / entry["dir"] / entry["file"]).is_file() and entry["file"].endswith(".gguf")


def test_a_failing_member_leaves_nothing_unless_tolerated(tiny_models, tmp_path):
    models = tiny_models("llama")

    def refuse(source: Path, out: Path) -> dict[str, Any]:
        raise ExportError(f"{source.name}: this target cannot take a model of this type")

    members = [Member("good", models["e1"], "m/good"), Member("broken", models["e2"], "m/broken", refuse)]
    out = tmp_path / "bundle"
    kw: dict[str, Any] = {"source": models["base"], "router": _router, "manifest": _manifest}
    with pytest.raises(ExportError):
        export_bundle(out, Bundle(members, "gguf", "f32", verify=False), **kw)
    assert not out.exists(), "a failed bundle is not moved into place"
    doc = export_bundle(out, Bundle(members, "gguf", "f32", verify=False, tolerate=True), **kw)
    assert doc["members"]["good"]["file"].endswith(".gguf")
    refused = doc["members"]["broken"]
    assert refused == {
        "target": "gguf",
        "exported": False,
        "reason": "e2: this target cannot take a model of this type",
    }


def test_a_member_with_a_writer_of_its_own(tiny_models, tmp_path):
    calls = []

    def writer(source: Path, out: Path) -> dict[str, Any]:
        out.mkdir(parents=True)
        (out / "own.bin").write_bytes(b"x")
        calls.append(source)
        return {"format": "own/1", "file": "own.bin", "target": "own", "parity": {"ok": True}}

    src = tiny_models("llama")["e1"]
    doc = export_bundle(
        tmp_path / "b", Bundle([Member("x", src, "x", writer)], "gguf"), source=src, router=_router,
        manifest=_manifest,
    )  # fmt: skip
    assert calls == [src]
    assert doc["members"]["x"] == {"target": "own", "dir": "x", "file": "own.bin", "parity": {"ok": True}}
    # verified: the bundle's parity holds the router's figures (none here) and each member's
    assert doc["parity"] == {"router": None, "members": {"x": {"ok": True}}}


def test_a_malformed_manifest_fails_where_it_is_returned(tiny_models, tmp_path):
    from moetool.export.base import Manifest

    def writer(source: Path, out: Path) -> dict[str, Any]:
        return {"file": 3}  # no format, a file that is not a name

    for tolerate in (False, True):  # a bug, not a refusal: never recorded as "not exported"
        with pytest.raises(ExportError, match="the writer of x: a manifest without a format"):
            export_bundle(
                tmp_path / "b", Bundle([Member("x", tiny_models("llama")["e1"], "x", writer)], "gguf",
                tolerate=tolerate), source=tiny_models("llama")["e1"], router=_router, manifest=_manifest,
            )  # fmt: skip
    assert not (tmp_path / "b").exists()
    with pytest.raises(ExportError, match="manifest field 'file' is 3, not a string"):
        Manifest.of({"format": "f", "file": 3}, source="s")
    m = Manifest.of(
        {"format": "moetool-artifact/1", "target": "gguf", "file": "a.gguf", "parity": "not verified"}, source="s"
    )
    assert m == {"format": "moetool-artifact/1", "target": "gguf", "file": "a.gguf", "parity": "not verified"}
    assert (m.target, m.file, m.verified) == ("gguf", "a.gguf", False)
