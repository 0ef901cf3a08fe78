"""Maintainers: pin the zoo corpora (src/moetool/zoo/corpora.lock.json) from this machine's text.

The legal domain is pinned from Debian's common licences and the licence files of the distributions that
`scripts/setup.sh --llama` installs (moetool's runtime dependencies and the llama extra, found through the installed
metadata), so a user's install holds every pinned document; code and medical from what is installed.

    .venv/bin/python scripts/pin_corpora.py
"""

from __future__ import annotations

import os
import re
from importlib import metadata

from packaging.requirements import Requirement

from moetool.zoo import corpora
from moetool.zoo.pins import PIN_FILE, write_pins


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(root: str = "moetool", extras: tuple[str, ...] = ("llama",)) -> set[str]:
    """Distribution names installed for ``root[extras]``, following requirements through their markers."""
    seen: set[str] = set()
    todo = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        key = _key(name)
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(key)
        for raw in dist.requires or []:
            req = Requirement(raw)
            envs = [{"extra": e} for e in ("", *wanted)]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, tuple(req.extras)))
    return seen


def main() -> None:
    os.environ["MOETOOL_CORPUS"] = "machine"
    dists = runtime_closure()
    docs = {
        "code": corpora.load_domain_documents("code"),
        "legal": corpora._legal_documents(dists=dists),
        "medical": corpora.load_domain_documents("medical"),
    }
    write_pins(docs)
    for d, texts in docs.items():
        print(f"{d}: {len(texts)} documents, {sum(map(len, texts)):,} characters")
    print(f"legal: licence files of {len(dists)} distributions: {', '.join(sorted(dists))}")
    print(f"wrote {PIN_FILE}")


if __name__ == "__main__":
    main()
