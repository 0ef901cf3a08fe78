"""Model card (README.md with Hub front matter) and provenance for a merged checkpoint."""

from __future__ import annotations

import hashlib
import platform
import re
from collections.abc import Mapping
from pathlib import Path

from moetool import __version__
from moetool.arch.records import consumer_caveats
from moetool.io.checkpoint import Checkpoint
from moetool.io.hashes import cached_sha256, sha256_file
from moetool.io.jsontypes import JsonObject, JsonValue
from moetool.io.sources import ResolvedSource

_REPO_ID_LIKE = ("hf-cache",)


def source_hashes(sources: Mapping[str, ResolvedSource], *, allow_pickle: bool = False) -> dict[Path, str]:
    """sha256 of every weight file of every source (each file once), remembered across runs for unchanged files
    (:mod:`moetool.io.hashes`). Reading and hashing release the GIL, so a merge runs this in a thread beside its
    tensor stream (:func:`provenance` takes the result)."""
    files = {f for src in sources.values() for f in Checkpoint(src.path, allow_pickle=allow_pickle).weight_files}
    return cached_sha256(sorted(files))


def provenance(
    sources: Mapping[str, ResolvedSource],
    recipe_text: str,
    *,
    allow_pickle: bool = False,
    hashes: dict[Path, str] | None = None,
) -> JsonObject:
    """Sources (reference, resolved path, kind, Hub revision, weight-file hashes) and tool versions; ``hashes`` from
    :func:`source_hashes` when they were computed already."""
    import torch
    import transformers

    listed: JsonObject = {}
    for label, src in sources.items():
        files = Checkpoint(src.path, allow_pickle=allow_pickle).weight_files
        hashed: dict[str, JsonValue] = {f.name: hashes[f] if hashes and f in hashes else sha256_file(f) for f in files}
        listed[label] = {
            "ref": src.ref,
            "kind": src.kind,
            "path": str(src.path),
            "revision": src.revision,
            "files": hashed,
        }
    return {
        "moetool": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "recipe_sha256": hashlib.sha256(recipe_text.encode()).hexdigest(),
        "sources": listed,
    }


def base_model_ids(sources: Mapping[str, ResolvedSource]) -> list[str]:
    """``base_model`` entries: only Hub repo ids (from the local HF cache). Zoo and local models have no Hub id and
    the Hub rejects made-up ones, so they are listed in the card's Sources table instead."""
    seen: list[str] = []
    for src in sources.values():
        if src.kind in _REPO_ID_LIKE and src.ref not in seen:
            seen.append(src.ref)
    return seen


def limits_section(config: Mapping[str, object]) -> str:
    """A model card's "Known limits" section for ``config`` (config.json as a dict); empty when it has none."""
    caveats = consumer_caveats(config)
    return "## Known limits\n\n" + "".join(f"- {c}.\n" for c in caveats) + "\n" if caveats else ""


def model_card(
    *,
    name: str,
    method: str,
    arch: str,
    experts: list[str],
    top_k: int,
    gate_mode: str,
    sources: Mapping[str, ResolvedSource],
    recipe_text: str,
    extra_sections: str = "",
) -> str:
    """Render README.md: YAML front matter the Hub understands, then what was merged and how."""
    from huggingface_hub import ModelCardData

    hub_ids = base_model_ids(sources)
    data = ModelCardData(
        base_model=hub_ids or None,
        base_model_relation="merge" if hub_ids else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["moe", "moetool", "merge", method, arch],
    )
    rows = "\n".join(f"| {label} | `{src.ref}` | {src.kind} |" for label, src in sources.items())
    return (
        f"---\n{data.to_yaml()}\n---\n\n# {name}\n\n"
        f"A Mixture-of-Experts model built by [moetool](https://github.com/) with `method: {method}`: "
        f"attention, norms and embeddings come from the base model; each expert's FFN becomes one routed expert.\n\n"
        f"- architecture: `{arch}`\n- experts: {', '.join(f'`{e}`' for e in experts)}\n"
        f"- experts per token: {top_k}\n- router initialisation: `{gate_mode}`\n\n"
        f"## Sources\n\n| role | reference | kind |\n|---|---|---|\n{rows}\n\n"
        "File hashes and versions are in `moetool.json`.\n\n"
        f"{extra_sections}"
        f"## Recipe\n\n```yaml\n{recipe_text.rstrip()}\n```\n"
    )


def put_section(card: str, heading: str, body: str) -> str:
    """``card`` with its ``## heading`` section (up to the next ``## ``) replaced by ``body``, placed before the
    "Recipe" section when the card has one, else at its end."""
    card = re.sub(rf"## {re.escape(heading)}\n\n.*?\n\n(?=## |\Z)", "", card, flags=re.S)
    section = f"## {heading}\n\n{body}"
    return card.replace("## Recipe\n", section + "## Recipe\n", 1) if "## Recipe\n" in card else card + section
