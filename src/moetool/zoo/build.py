"""Build the expert zoo: a shared base model and one domain expert per corpus, trained here on the CPU.

The zoo is the demo material of moetool: small Llama models that share a tokenizer and a base, and differ in
what their MLPs learned (the MoFE setting: experts continue from the base with only ``gate_proj``/``up_proj``/
``down_proj`` trainable, so a Mixture-of-Experts built from base + experts is meaningful).

Layout of ``zoo_dir(profile)``::

    base/ code/ legal/ medical/     save_pretrained dirs (config, model.safetensors, tokenizer files)
    data/<domain>/train.txt         the training text of each domain
    data/<domain>/valid.txt         its held-out text
    zoo.json                        config, seed, build time, perplexity matrix, versions
"""

from __future__ import annotations

import copy
import json
import platform
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console

import moetool
from moetool.compute.stream import quiet_transformers
from moetool.errors import MoetoolError
from moetool.eval.perplexity import perplexity_matrix, render_matrix
from moetool.io.atomic import atomic_dir, occupied, pid_alive
from moetool.io.jsontypes import JsonObject
from moetool.paths import zoo_dir
from moetool.progress import task
from moetool.train.loop import LoopConfig, derive_seed, train_lm
from moetool.zoo.config import (
    BASE_NAME,
    ZOO_FORMAT,
    ZOO_JSON,
    ExpertCheck,
    VocabFields,
    ZooConfig,
    ZooMeta,
    ZooResult,
)
from moetool.zoo.corpora import DOMAINS, DomainSplit, corpus_stats, make_splits
from moetool.zoo.pins import pin_id
from moetool.zoo.store import read_zoo_json, zoo_check_passed, zoo_listed_models, zoo_perplexity
from moetool.zoo.tokenizer import train_tokenizer

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["build_zoo", "quiet_transformers", "remove_stale_builds", "tool_versions", "train_zoo_model", "vocab_fields"]


def train_zoo_model(
    model: torch.nn.Module,
    *,
    console: Console,
    name: str,
    steps: int,
    streams: list[torch.Tensor],
    mix: list[int],
    lr: float,
    cfg: LoopConfig,
    bos_id: int,
) -> dict[str, float]:
    """:func:`moetool.train.loop.train_lm` (the same streams, mix, lr, cfg, bos_id) with a progress line on
    ``console`` and a summary line after; returns its statistics."""
    with task(console, f"{name:>8}", steps) as advance:
        stats = train_lm(
            model, name=name, steps=steps, advance=advance, streams=streams, mix=mix, lr=lr, cfg=cfg, bos_id=bos_id
        )
    console.print(
        f"{name}: {steps} steps, loss {stats['final_loss_ema']:.3f}, {stats['tokens_per_second']:.0f} tok/s, "
        f"{stats['seconds']:.0f} s",
        highlight=False,
    )
    return stats


def vocab_fields(tokenizer: PreTrainedTokenizerBase) -> VocabFields:
    """What a zoo model's config takes from the zoo tokenizer: the vocabulary size and the special token ids."""
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _model_config(cfg: ZooConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        **vocab_fields(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq_len * 2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_dropout=0.0,
    )


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def tool_versions() -> dict[str, str]:
    """The versions a build depends on (recorded in zoo.json and moetool.json)."""
    import tokenizers
    import transformers

    return {
        "moetool": moetool.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _check_experts(matrix: dict[str, dict[str, float]], domains: tuple[str, ...]) -> ExpertCheck:
    failures = []
    gains = {}
    for d in domains:
        base, expert = matrix[BASE_NAME][d], matrix[d][d]
        gain = (base - expert) / base
        gains[d] = round(gain, 4)
        if not expert < base:
            failures.append(
                f"expert {d!r} does not beat the base on {d!r} held-out text: perplexity {expert:.3f} vs "
                f"{base:.3f} (worse by {expert - base:.3f}, {-100 * gain:.1f}%)"
            )
    return {"passed": not failures, "failures": failures, "relative_improvement": gains}


# ------------------------------------------------------------------------------------ stale temporary dirs


def remove_stale_builds(root: Path) -> None:
    """Delete the temporary directories ``.NAME.building-PID-…`` that zoo builds before :func:`atomic_dir` left
    next to ``root`` when killed (``atomic_dir`` sweeps its own leftovers)."""
    for d in root.parent.glob(f".{root.name}.building-*"):
        pid = d.name.rsplit(".building-", 1)[1].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- build


def _reuse(root: Path, cfg_json: JsonObject, *, force: bool, console: Console) -> ZooResult | None:
    """The zoo already at ``root`` if it was built with the same config and passed its check (unless ``force``).

    Raises:
        MoetoolError: ``root`` holds something else than a zoo and ``force`` is not set.
    """
    existing = read_zoo_json(root)
    if existing is not None and not force:
        same = existing.get("config") == cfg_json and existing.get("corpus_pins") == pin_id()
        if same and zoo_check_passed(existing):
            console.print(f"[green]zoo[/] {root} is up to date (--force rebuilds it)")
            seconds = existing.get("build_seconds", 0.0)
            return ZooResult(
                root=root,
                perplexity=zoo_perplexity(existing),
                seconds=float(seconds) if isinstance(seconds, int | float) else 0.0,
                cached=True,
                models=zoo_listed_models(existing),
            )
        reason = "its config or corpus pins differ" if not same else "its expert check failed"
        console.print(f"[yellow]rebuilding zoo[/] {root}: {reason}")
    elif existing is None and occupied(root) and not force:
        raise MoetoolError(f"{root} exists and is not a moetool zoo; remove it or pass force")
    return None


def _write_corpora(tmp: Path, cfg: ZooConfig, console: Console) -> dict[str, DomainSplit]:
    splits: dict[str, DomainSplit] = make_splits(
        cfg.seed, cfg.max_chars_per_domain, cfg.valid_fraction, max_valid_chars=cfg.max_valid_chars
    )
    for d, s in splits.items():
        if s.corpus is not None and s.corpus.warning:
            console.print(f"[yellow]warning[/]: {s.corpus.warning}")
        (tmp / "data" / d).mkdir(parents=True)
        (tmp / "data" / d / "train.txt").write_text(s.train, encoding="utf-8")
        (tmp / "data" / d / "valid.txt").write_text(s.valid, encoding="utf-8")
    return splits


def _tokenize(
    splits: dict[str, DomainSplit], cfg: ZooConfig, console: Console
) -> tuple[PreTrainedTokenizerBase, list[torch.Tensor], dict[str, dict[str, int]]]:
    """A tokenizer trained on every domain's train text only, each domain's train stream ``[N_d]``, corpus stats."""

    tokenizer = train_tokenizer(
        [splits[d].train[: cfg.tokenizer_chars_per_domain] for d in DOMAINS],
        vocab_size=cfg.vocab_size,
        model_max_length=cfg.seq_len * 2,
    )
    streams = [
        torch.tensor(tokenizer(splits[d].train, add_special_tokens=False, verbose=False)["input_ids"]) for d in DOMAINS
    ]
    stats = corpus_stats(splits)
    for d, st in zip(DOMAINS, streams, strict=True):
        if st.numel() < cfg.seq_len + 1:
            raise MoetoolError(f"domain {d!r} has too little training text ({st.numel()} tokens)")
        stats[d]["train_tokens"] = int(st.numel())
    chars = ", ".join(f"{d} {stats[d]['train_chars'] / 1e3:.0f}K/{stats[d]['valid_chars'] / 1e3:.0f}K" for d in DOMAINS)
    console.print(f"corpora (train/held-out chars): {chars}")
    console.print(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens")
    return tokenizer, streams, stats


def _train_models(
    tmp: Path, cfg: ZooConfig, tokenizer: PreTrainedTokenizerBase, streams: list[torch.Tensor], console: Console
) -> tuple[dict[str, dict[str, float]], int]:
    """Train and save the base (on every domain), then each expert from it (on its own); returns the training
    statistics per model and the parameter count."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    base = AutoModelForCausalLM.from_config(_model_config(cfg, tokenizer), attn_implementation=cfg.attn_implementation)
    n_params = sum(p.numel() for p in base.parameters())
    console.print(
        f"model: Llama, {cfg.num_layers} layers, hidden {cfg.hidden_size}, ffn {cfg.intermediate_size}, "
        f"{n_params / 1e6:.2f}M params; experts train: {cfg.expert_trainable}"
    )
    bos_id = int(tokenizer.bos_token_id)
    training = {
        BASE_NAME: train_zoo_model(
            base,
            console=console,
            name=BASE_NAME,
            mix=list(range(len(DOMAINS))),
            steps=cfg.base_steps,
            lr=cfg.lr,
            streams=streams,
            cfg=cfg,
            bos_id=bos_id,
        )
    }
    _save(base, tokenizer, tmp / BASE_NAME)
    for i, d in enumerate(DOMAINS):
        torch.manual_seed(derive_seed(cfg.seed, f"expert:{d}"))
        expert = copy.deepcopy(base)
        for name, p in expert.named_parameters():
            p.requires_grad_(cfg.expert_trainable == "all" or ".mlp." in name)
        lr = cfg.expert_lr if cfg.expert_lr is not None else cfg.lr
        training[d] = train_zoo_model(
            expert,
            console=console,
            name=d,
            mix=[i],
            steps=cfg.expert_steps,
            lr=lr,
            streams=streams,
            cfg=cfg,
            bos_id=bos_id,
        )
        expert.requires_grad_(True)
        _save(expert, tokenizer, tmp / d)
        del expert
    return training, n_params


def _evaluate(
    tmp: Path, profile: str, cfg: ZooConfig, splits: dict[str, DomainSplit], console: Console
) -> tuple[dict[str, dict[str, float]], ExpertCheck]:
    """The held-out perplexity matrix of the saved models and the expert check."""

    with console.status("evaluating held-out perplexity"):
        matrix = perplexity_matrix(
            {n: tmp / n for n in (BASE_NAME, *DOMAINS)},
            {d: splits[d].valid for d in DOMAINS},
            seq_len=cfg.seq_len,
            max_tokens=cfg.eval_max_tokens,
        )
    check = _check_experts(matrix, DOMAINS)
    console.print(render_matrix(matrix, f"held-out perplexity, zoo '{profile}'"))
    gains = ", ".join(f"{d} {100 * g:+.1f}%" for d, g in check["relative_improvement"].items())
    console.print(f"expert vs base on own domain (perplexity reduction): {gains}")
    return matrix, check


def _build_into(tmp: Path, profile: str, cfg: ZooConfig, console: Console, t_start: float) -> ZooMeta:
    """Everything of the zoo into ``tmp``; returns what zoo.json records."""
    torch.manual_seed(cfg.seed)
    splits = _write_corpora(tmp, cfg, console)
    tokenizer, streams, stats = _tokenize(splits, cfg, console)
    training, n_params = _train_models(tmp, cfg, tokenizer, streams, console)
    matrix, check = _evaluate(tmp, profile, cfg, splits, console)
    meta: ZooMeta = {
        "format": ZOO_FORMAT,
        "profile": profile,
        "config": json.loads(json.dumps(cfg.to_dict())),
        "seed": cfg.seed,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": round(time.perf_counter() - t_start, 2),
        "models": [BASE_NAME, *DOMAINS],
        "domains": list(DOMAINS),
        "perplexity": matrix,
        "check": check,
        "training": training,
        "corpus": stats,
        "corpus_pins": pin_id(),
        "corpus_documents": {d: s.corpus.to_json() for d, s in splits.items() if s.corpus is not None},
        "model": {"architecture": "LlamaForCausalLM", "parameters": n_params},
        "versions": tool_versions(),
        "platform": {"machine": platform.machine(), "torch_threads": torch.get_num_threads()},
    }
    (tmp / ZOO_JSON).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def build_zoo(
    profile: str = "default",
    *,
    root: Path | None = None,
    force: bool = False,
    console: Console | None = None,
    config: ZooConfig | None = None,
) -> ZooResult:
    """Build the expert zoo of ``profile`` (corpora, tokenizer, base, one expert per domain, eval matrix).

    Writes into ``root`` (default ``zoo_dir(profile)``) through a temporary sibling directory that replaces
    ``root`` only when complete. A zoo already there with the same config (and a passed expert check) is reused
    unless ``force``.

    Args:
        profile: a key of :data:`PROFILES` (``"default"`` or ``"tiny"``).
        root: where to put the zoo.
        force: rebuild even when an identical zoo exists.
        console: where progress and the perplexity table go.
        config: overrides the profile's config (the profile name is still recorded).

    Raises:
        MoetoolError: a corpus is missing, or an expert does not beat the base on its own domain's held-out text
            (the zoo and its perplexity matrix are written first).
    """
    cfg = config if config is not None else ZooConfig.for_profile(profile)
    console = console if console is not None else Console()
    root = Path(root) if root is not None else zoo_dir(profile)
    cached = _reuse(root, json.loads(json.dumps(cfg.to_dict())), force=force, console=console)
    if cached is not None:
        return cached

    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    root.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(root)
    console.print(f"[bold]building zoo[/] profile={profile} seed={cfg.seed} -> {root}")
    try:
        # force: _reuse has already refused a directory that is not a zoo; an outdated zoo is replaced
        with atomic_dir(root, force=True) as tmp, quiet_transformers():
            meta = _build_into(tmp, profile, cfg, console, t_start)
    finally:
        torch.set_num_threads(threads_before)

    seconds = float(meta["build_seconds"])
    console.print(f"[green]zoo built[/] in {seconds:.0f} s -> {root}")
    check = meta["check"]
    if not check["passed"]:
        raise MoetoolError("zoo check failed: " + "; ".join(check["failures"]) + f" (see {root / ZOO_JSON})")
    return ZooResult(root=root, perplexity=meta["perplexity"], seconds=seconds, cached=False, models=meta["models"])


if __name__ == "__main__":  # pragma: no cover - `python -m moetool.zoo.build [profile]`
    _profile = sys.argv[1] if len(sys.argv) > 1 else "default"
    build_zoo(_profile, force="--force" in sys.argv)
