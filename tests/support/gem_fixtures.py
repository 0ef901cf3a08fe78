"""Tiny GEM inputs: a general model, experts differing only in their MLPs, and domain-labelled text files."""

from __future__ import annotations

import random
from pathlib import Path

from conftest import save_dense

WORDS = {
    "code": [
        "def",
        "return",
        "import",
        "class",
        "self",
        "print",
        "for",
        "while",
        "lambda",
        "yield",
        "os",
        "path",
        "join",
        "list",
        "dict",
    ],
    "legal": [
        "licence",
        "hereby",
        "granted",
        "warranty",
        "liability",
        "copyright",
        "permission",
        "software",
        "notice",
        "terms",
    ],
    "medical": [
        "fracture",
        "femur",
        "bronchitis",
        "diabetes",
        "acute",
        "chronic",
        "cholera",
        "kidney",
        "virus",
        "encounter",
    ],
}


def domain_text(domain: str, docs: int = 40, seed: int = 0) -> str:
    """``docs`` documents of one domain's words, separated by blank lines (load_source splits on them)."""
    rng = random.Random(f"{domain}-{seed}")
    return "\n\n".join(" ".join(rng.choice(WORDS[domain]) for _ in range(60)) for _ in range(docs))


def make_gem_inputs(root: Path, domains: tuple[str, ...] = ("code", "legal", "medical")) -> dict[str, Path]:
    """{'general', each domain, '<domain>_text'}: model dirs and text files under ``root``."""
    out = {"general": save_dense(root / "general")}
    for i, d in enumerate(domains, 1):
        out[d] = save_dense(root / d, seed=i, base=out["general"], mlp_noise=0.3)
        text = root / f"{d}.txt"
        text.write_text(domain_text(d))
        out[f"{d}_text"] = text
    return out


def recipe_text(
    paths: dict[str, Path],
    domains: tuple[str, ...] = ("code", "legal", "medical"),
    *,
    level: str = "token",
    extra: str = "",
) -> str:
    doms = "".join(
        f"  - name: {d}\n    source: {paths[d]}\n    data: {{text: {paths[d + '_text']}}}\n" for d in domains
    )
    return (
        f"name: tiny-gem\nmethod: gem\ngeneral: {paths['general']}\nlevel: {level}\ndomains:\n{doms}"
        "router:\n  steps: 40\n  learning_rate: 0.05\n  batch_size: 6\n  seq_len: 32\n  eval_tokens: 512\n" + extra
    )
