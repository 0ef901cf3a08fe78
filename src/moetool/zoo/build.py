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

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from moetool.errors import MoetoolError
from moetool.paths import zoo_dir
from moetool.zoo.corpora import DOMAINS, DomainSplit, corpus_stats, make_splits

__all__ = [
    "PROFILES",
    "ZooConfig",
    "ZooResult",
    "build_zoo",
    "resolve_zoo_model",
    "zoo_domain_text",
    "zoo_models",
]

ZOO_FORMAT = 1
BASE_NAME = "base"
ZOO_JSON = "zoo.json"


@dataclass(frozen=True)
class ZooConfig:
    """Everything that determines a zoo build (same config and machine -> same weights)."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 8
    base_steps: int = 750
    expert_steps: int = 280
    lr: float = 6e-3
    expert_lr: float | None = None  # None: same as lr
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    seed: int = 0
    max_chars_per_domain: int = 3_000_000
    valid_fraction: float = 0.1
    max_valid_chars: int | None = 80_000
    tokenizer_chars_per_domain: int = 400_000  # balanced tokenizer training sample
    expert_trainable: Literal["mlp", "all"] = "mlp"
    tie_word_embeddings: bool = True
    eval_max_tokens: int = 32768
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    # torch threads while building (None: leave torch's setting alone). Results are reproducible for the same
    # seed, config and thread count on the same machine.
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.expert_trainable not in ("mlp", "all"):
            raise MoetoolError(f"expert_trainable must be 'mlp' or 'all', got {self.expert_trainable!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise MoetoolError(
                "hidden_size must be divisible by num_heads, and num_heads by num_kv_heads "
                f"(got {self.hidden_size}, {self.num_heads}, {self.num_kv_heads})"
            )
        if self.seq_len < 8 or self.batch_size < 1 or self.base_steps < 1 or self.expert_steps < 1:
            raise MoetoolError("seq_len, batch_size, base_steps and expert_steps must be positive")

    @classmethod
    def for_profile(cls, profile: str) -> ZooConfig:
        """The config of a named profile (see :data:`PROFILES`)."""
        try:
            return PROFILES[profile]
        except KeyError:
            raise MoetoolError(
                f"unknown zoo profile {profile!r}; known profiles: {', '.join(sorted(PROFILES))}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields."""
        return dataclasses.asdict(self)


PROFILES: dict[str, ZooConfig] = {
    # The whole zoo (corpora, tokenizer, base, 3 experts, eval) in ~6-8 min on 2 CPU cores.
    "default": ZooConfig(),
    # For tests: seconds, not minutes.
    "tiny": ZooConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seq_len=64,
        batch_size=16,
        base_steps=60,
        expert_steps=40,
        lr=5e-3,
        max_chars_per_domain=60_000,
        valid_fraction=0.15,
        eval_max_tokens=4096,
        num_threads=1,  # matrices this small gain nothing from a second thread
    ),
}


@dataclass
class ZooResult:
    """What :func:`build_zoo` built (or found already built)."""

    root: Path
    perplexity: dict[str, dict[str, float]]
    seconds: float
    cached: bool = False
    models: list[str] = field(default_factory=list)

    @property
    def matrix(self) -> dict[str, dict[str, float]]:
        """Alias of :attr:`perplexity`: ``matrix[model][domain]``."""
        return self.perplexity


# -------------------------------------------------------------------------------------------- training


def _derive_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _lr_lambda(steps: int, warmup_fraction: float, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` (a multiplier of the peak learning rate)."""
    warmup = max(1, round(steps * warmup_fraction))

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return fn


def _sample_batch(
    streams: list[torch.Tensor],
    domains: list[int],
    seq_len: int,
    bos_id: int,
    gen: torch.Generator,
) -> torch.Tensor:
    """``[len(domains), seq_len]`` windows: ``<s>`` + ``seq_len - 1`` contiguous tokens of each row's stream."""
    span = seq_len - 1
    rows = []
    for d in domains:
        stream = streams[d]
        start = int(torch.randint(0, stream.numel() - span + 1, (1,), generator=gen))
        rows.append(stream[start : start + span])
    body = torch.stack(rows)
    bos = torch.full((body.size(0), 1), bos_id, dtype=torch.long)
    return torch.cat([bos, body], dim=1)


def _param_groups(params: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _train(
    model: torch.nn.Module,
    *,
    name: str,
    streams: list[torch.Tensor],
    mix: list[int],
    steps: int,
    lr: float,
    cfg: ZooConfig,
    bos_id: int,
    progress: Progress,
) -> dict[str, float]:
    """Train ``model`` in place for ``steps`` steps on windows from ``streams[d]`` for ``d`` in ``mix``."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in params]
    opt = torch.optim.AdamW(_param_groups(params, cfg.weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(steps, cfg.warmup_fraction, cfg.min_lr_ratio))
    gen = torch.Generator().manual_seed(_derive_seed(cfg.seed, f"data:{name}"))
    task = progress.add_task(f"{name:>8}", total=steps, loss=float("nan"), tps=0.0)
    tokens_per_step = cfg.batch_size * (cfg.seq_len - 1)
    model.train()
    t0 = time.perf_counter()
    ema: float | None = None
    loss_value = float("nan")
    for step in range(steps):
        # Balanced mix: row r of step s comes from mix[(r + s) % len(mix)].
        rows = [mix[(r + step) % len(mix)] for r in range(cfg.batch_size)]
        batch = _sample_batch(streams, rows, cfg.seq_len, bos_id, gen)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise MoetoolError(f"training of zoo model {name!r} diverged at step {step} (loss {loss_value})")
        ema = loss_value if ema is None else 0.9 * ema + 0.1 * loss_value
        elapsed = time.perf_counter() - t0
        progress.update(task, advance=1, loss=ema, tps=(step + 1) * tokens_per_step / max(elapsed, 1e-9))
    seconds = time.perf_counter() - t0
    model.eval()
    return {
        "steps": steps,
        "seconds": round(seconds, 2),
        "tokens": steps * tokens_per_step,
        "tokens_per_second": round(steps * tokens_per_step / max(seconds, 1e-9), 1),
        "final_loss": round(loss_value, 4),
        "final_loss_ema": round(ema if ema is not None else float("nan"), 4),
        "trainable_parameters": sum(p.numel() for p in trainable),
    }


def _model_config(cfg: ZooConfig, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq_len * 2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attention_dropout=0.0,
    )


def _set_expert_trainable(model: torch.nn.Module, mode: str) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(mode == "all" or ".mlp." in name)


def _save(model: Any, tokenizer: Any, path: Path) -> None:
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' own progress bars and info logs while the zoo draws its own."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _versions() -> dict[str, str]:
    import tokenizers
    import transformers

    import moetool

    return {
        "moetool": moetool.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _check_experts(matrix: dict[str, dict[str, float]], domains: tuple[str, ...]) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------- build


def _read_zoo_json(root: Path) -> dict[str, Any] | None:
    path = root / ZOO_JSON
    if not path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid < 2**22  # exists but belongs to someone else; absurd pids cannot exist
    return True


def _remove_stale_builds(root: Path) -> None:
    """Delete temporary build directories of ``root`` left by builds whose process no longer runs (killed builds)."""
    for d in root.parent.glob(f".{root.name}.building-*"):
        pid = d.name.rsplit(".building-", 1)[1].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


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
    from moetool.eval.perplexity import perplexity_matrix, render_matrix
    from moetool.zoo.tokenizer import train_tokenizer

    cfg = config if config is not None else ZooConfig.for_profile(profile)
    console = console if console is not None else Console()
    root = Path(root) if root is not None else zoo_dir(profile)
    cfg_json = json.loads(json.dumps(cfg.to_dict()))

    existing = _read_zoo_json(root)
    if existing is not None and not force:
        if existing.get("config") == cfg_json and existing.get("check", {}).get("passed"):
            console.print(f"[green]zoo[/] {root} is up to date (--force rebuilds it)")
            return ZooResult(
                root=root,
                perplexity=existing["perplexity"],
                seconds=float(existing.get("build_seconds", 0.0)),
                cached=True,
                models=list(existing.get("models", [])),
            )
        reason = "its config differs" if existing.get("config") != cfg_json else "its expert check failed"
        console.print(f"[yellow]rebuilding zoo[/] {root}: {reason}")
    elif existing is None and root.exists() and (not root.is_dir() or any(root.iterdir())) and not force:
        raise MoetoolError(f"{root} exists and is not a moetool zoo; remove it or pass force")

    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    root.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(root)
    tmp = root.parent / f".{root.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with _quiet_transformers():
            torch.manual_seed(cfg.seed)
            console.print(f"[bold]building zoo[/] profile={profile} seed={cfg.seed} -> {root}")

            # 1. corpora
            splits: dict[str, DomainSplit] = make_splits(
                cfg.seed, cfg.max_chars_per_domain, cfg.valid_fraction, max_valid_chars=cfg.max_valid_chars
            )
            for d, s in splits.items():
                (tmp / "data" / d).mkdir(parents=True)
                (tmp / "data" / d / "train.txt").write_text(s.train, encoding="utf-8")
                (tmp / "data" / d / "valid.txt").write_text(s.valid, encoding="utf-8")

            # 2. tokenizer (train text of every domain only)
            tokenizer = train_tokenizer(
                [splits[d].train[: cfg.tokenizer_chars_per_domain] for d in DOMAINS],
                vocab_size=cfg.vocab_size,
                model_max_length=cfg.seq_len * 2,
            )
            streams = [
                torch.tensor(tokenizer(splits[d].train, add_special_tokens=False, verbose=False)["input_ids"])
                for d in DOMAINS
            ]
            for d, st in zip(DOMAINS, streams, strict=True):
                if st.numel() < cfg.seq_len + 1:
                    raise MoetoolError(f"domain {d!r} has too little training text ({st.numel()} tokens)")
            stats: dict[str, Any] = corpus_stats(splits)
            for d, st in zip(DOMAINS, streams, strict=True):
                stats[d]["train_tokens"] = int(st.numel())
            console.print(
                "corpora (train/held-out chars): "
                + ", ".join(
                    f"{d} {stats[d]['train_chars'] / 1e3:.0f}K/{stats[d]['valid_chars'] / 1e3:.0f}K" for d in DOMAINS
                )
            )
            console.print(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens")

            # 3. base + experts
            from transformers import AutoModelForCausalLM

            model_cfg = _model_config(cfg, tokenizer)
            torch.manual_seed(cfg.seed)
            base = AutoModelForCausalLM.from_config(model_cfg, attn_implementation=cfg.attn_implementation)
            n_params = sum(p.numel() for p in base.parameters())
            console.print(
                f"model: Llama, {cfg.num_layers} layers, hidden {cfg.hidden_size}, ffn {cfg.intermediate_size}, "
                f"{n_params / 1e6:.2f}M params; experts train: {cfg.expert_trainable}"
            )
            training: dict[str, dict[str, float]] = {}
            progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.3f}"),
                TextColumn("{task.fields[tps]:>6.0f} tok/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )
            bos_id = int(tokenizer.bos_token_id)
            with progress:
                all_domains = list(range(len(DOMAINS)))
                training[BASE_NAME] = _train(
                    base,
                    name=BASE_NAME,
                    streams=streams,
                    mix=all_domains,
                    steps=cfg.base_steps,
                    lr=cfg.lr,
                    cfg=cfg,
                    bos_id=bos_id,
                    progress=progress,
                )
                _save(base, tokenizer, tmp / BASE_NAME)
                for i, d in enumerate(DOMAINS):
                    torch.manual_seed(_derive_seed(cfg.seed, f"expert:{d}"))
                    expert = copy.deepcopy(base)
                    _set_expert_trainable(expert, cfg.expert_trainable)
                    training[d] = _train(
                        expert,
                        name=d,
                        streams=streams,
                        mix=[i],
                        steps=cfg.expert_steps,
                        lr=cfg.expert_lr if cfg.expert_lr is not None else cfg.lr,
                        cfg=cfg,
                        bos_id=bos_id,
                        progress=progress,
                    )
                    expert.requires_grad_(True)
                    _save(expert, tokenizer, tmp / d)
                    del expert
            del base

            # 4. held-out perplexity matrix, from the saved directories
            names = [BASE_NAME, *DOMAINS]
            with console.status("evaluating held-out perplexity"):
                matrix = perplexity_matrix(
                    {n: tmp / n for n in names},
                    {d: splits[d].valid for d in DOMAINS},
                    seq_len=cfg.seq_len,
                    max_tokens=cfg.eval_max_tokens,
                )
            check = _check_experts(matrix, DOMAINS)
            seconds = time.perf_counter() - t_start
            console.print(render_matrix(matrix, f"held-out perplexity, zoo '{profile}'"))
            gains = ", ".join(f"{d} {100 * g:+.1f}%" for d, g in check["relative_improvement"].items())
            console.print(f"expert vs base on own domain (perplexity reduction): {gains}")

            meta = {
                "format": ZOO_FORMAT,
                "profile": profile,
                "config": cfg_json,
                "seed": cfg.seed,
                "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "build_seconds": round(seconds, 2),
                "models": names,
                "domains": list(DOMAINS),
                "perplexity": matrix,
                "check": check,
                "training": training,
                "corpus": stats,
                "model": {"architecture": "LlamaForCausalLM", "parameters": n_params},
                "versions": _versions(),
                "platform": {"machine": platform.machine(), "torch_threads": torch.get_num_threads()},
            }
            (tmp / ZOO_JSON).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

            # 5. move into place
            old: Path | None = None
            if root.exists() or root.is_symlink():
                old = root.parent / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(root, old)
            os.replace(tmp, root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads_before)

    console.print(f"[green]zoo built[/] in {seconds:.0f} s -> {root}")
    if not check["passed"]:
        raise MoetoolError("zoo check failed: " + "; ".join(check["failures"]) + f" (see {root / ZOO_JSON})")
    return ZooResult(root=root, perplexity=matrix, seconds=seconds, cached=False, models=names)


# ------------------------------------------------------------------------------------------- lookups


def zoo_models(profile: str = "default") -> list[str]:
    """Names of the models in the zoo of ``profile`` (empty if it is not built)."""
    root = zoo_dir(profile)
    if not root.is_dir():
        return []
    meta = _read_zoo_json(root)
    on_disk = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())
    if meta is not None and meta.get("models"):
        # zoo.json's models first, then models trained into the zoo later (e.g. `moetool hybrid zoo-mamba`)
        listed = [m for m in meta["models"] if m in on_disk]
        return listed + [m for m in on_disk if m not in listed]
    return on_disk


def _build_hint(profile: str) -> str:
    return "`moetool zoo build`" if profile == "default" else f"`moetool zoo build --profile {profile}`"


def resolve_zoo_model(name: str, profile: str = "default") -> Path:
    """Directory of zoo model ``name`` (``base`` or a domain) of ``profile``.

    Raises:
        MoetoolError: the zoo is not built, or has no model of that name.
    """
    path = zoo_dir(profile) / name
    if name and "/" not in name and (path / "config.json").is_file():
        return path
    available = zoo_models(profile)
    listing = f"available: {', '.join(available)}" if available else f"the {profile!r} zoo is not built"
    raise MoetoolError(f"zoo model {name!r} not found; run {_build_hint(profile)} ({listing})")


def zoo_domain_text(domain: str, split: Literal["train", "valid"] = "valid", profile: str = "default") -> str:
    """The ``train`` or held-out (``valid``) text of ``domain`` that the zoo of ``profile`` was built with."""
    if split not in ("train", "valid"):
        raise MoetoolError(f"split must be 'train' or 'valid', got {split!r}")
    if domain not in DOMAINS:
        raise MoetoolError(f"unknown zoo domain {domain!r}; known domains: {', '.join(DOMAINS)}")
    path = zoo_dir(profile) / "data" / domain / f"{split}.txt"
    if not path.is_file():
        raise MoetoolError(f"zoo text {path} not found; run {_build_hint(profile)}")
    return path.read_text(encoding="utf-8")


if __name__ == "__main__":  # pragma: no cover - `python -m moetool.zoo.build [profile]`
    _profile = sys.argv[1] if len(sys.argv) > 1 else "default"
    build_zoo(_profile, force="--force" in sys.argv)
