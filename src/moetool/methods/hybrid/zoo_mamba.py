"""A zoo Mamba expert: a small ``MambaForCausalLM`` trained here, the way the zoo trains its Transformers.

Same tokenizer (the zoo's, read from ``<zoo>/base``), same corpora and splits (``<zoo>/data/<domain>/``), same
training loop (:func:`moetool.zoo.train_zoo_model`: optimiser, schedule, balanced domain mix, batch sampler) as the
zoo's Transformers. It is cached next to the zoo as ``<zoo>/mamba`` (written atomically), so ``zoo:mamba`` resolves
through the ordinary ``resolve_zoo_model``.

transformers runs Mamba's sequential reference scan on CPU (no ``mamba_ssm`` kernels). Its backward indexes one
time step at a time out of ``[B, D, T, N]`` tensors, and every such index materialises a full-size gradient, which
makes a training step ~12x slower than it needs to be. :func:`fast_scan` is the same recurrence with the time axis
unbound once; it is patched in while training and evaluating here, and :func:`check_fast_scan` proves it equal
to transformers' own scan on every build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console

from moetool.errors import MoetoolError
from moetool.eval.perplexity import perplexity
from moetool.io.atomic import atomic_dir
from moetool.paths import zoo_dir
from moetool.train.loop import LoopConfig, derive_seed
from moetool.zoo import BASE_NAME, DOMAINS, quiet_transformers, remove_stale_builds, train_zoo_model, vocab_fields

MAMBA_NAME = "mamba"
MAMBA_JSON = "mamba.json"


@dataclass(frozen=True)
class MambaZooConfig(LoopConfig):
    """Everything that determines the zoo Mamba build: the zoo's training-loop settings (the
    :class:`~moetool.train.loop.LoopConfig` defaults, as the zoo's Transformers) and these. Small enough for ~5 min
    on one CPU thread."""

    hidden_size: int = 64
    num_layers: int = 2
    state_size: int = 16
    expand: int = 2
    conv_kernel: int = 4
    steps: int = 300
    lr: float = 6e-3
    eval_max_tokens: int = 16384
    num_threads: int = 1


def fast_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **_: Any,
) -> Any:
    """transformers' ``mamba_selective_scan`` recurrence with the time axis unbound once (cheap backward).

    hidden_states, dt, z: ``[B, D, T]``; A: ``[D, N]``; B, C: ``[B, N, T]``; D: ``[D]``. Returns ``[B, D, T]``
    (and the last state ``[B, D, N]`` if asked).
    """
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    b_t, c_t = B.transpose(1, 2), C.transpose(1, 2)  # [B, T, N]
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [B, D, T, N]
    inject = dt[:, :, :, None] * b_t[:, None, :, :].float() * hidden_states[:, :, :, None].float()
    state = torch.zeros(hidden_states.shape[0], hidden_states.shape[1], A.shape[-1], dtype=hidden_states.dtype)
    outs = []
    for a, b, c in zip(decay.unbind(2), inject.unbind(2), c_t.unbind(1), strict=True):
        state = a * state + b
        outs.append(torch.matmul(state.to(hidden_states.dtype), c.unsqueeze(-1))[:, :, 0])
    y = torch.stack(outs, dim=-1)
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return (y, state) if return_last_state else y


@contextlib.contextmanager
def patched_scan() -> Iterator[None]:
    """Use :func:`fast_scan` in transformers' Mamba for the duration (CPU reference path only)."""
    import transformers.models.mamba.modeling_mamba as mm

    original = mm.mamba_selective_scan
    mm.mamba_selective_scan = fast_scan
    try:
        yield
    finally:
        mm.mamba_selective_scan = original


def check_fast_scan(model: Any, input_ids: torch.Tensor) -> float:
    """Max |Δlogit| between transformers' own scan and :func:`fast_scan` on ``input_ids`` ``[B, T]``.

    Raises:
        MoetoolError: they differ by more than 1e-4 (the patch would change the model).
    """
    with torch.no_grad():
        ref = model(input_ids=input_ids).logits
        with patched_scan():
            got = model(input_ids=input_ids).logits
    diff = float((ref - got).abs().max())
    if not diff <= 1e-4:
        raise MoetoolError(f"fast Mamba scan differs from transformers' by {diff:.2e} (max |Δlogit|)")
    return diff


def mamba_config(cfg: MambaZooConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
    from transformers import MambaConfig

    return MambaConfig(
        **vocab_fields(tokenizer),
        hidden_size=cfg.hidden_size,
        state_size=cfg.state_size,
        num_hidden_layers=cfg.num_layers,
        expand=cfg.expand,
        conv_kernel=cfg.conv_kernel,
        tie_word_embeddings=True,
        layer_norm_epsilon=1e-5,
    )


def _zoo_texts(zoo: Path, domains: tuple[str, ...]) -> dict[tuple[str, str], str]:
    """Each domain's train and held-out text of the zoo at ``zoo``, keyed ``(domain, split)``.

    Raises:
        MoetoolError: the zoo is not built, or its text is missing.
    """

    if not (zoo / BASE_NAME / "config.json").is_file():
        raise MoetoolError(
            f"zoo {zoo} is not built; run `moetool zoo build` first (the Mamba expert uses its tokenizer)"
        )
    texts = {}
    for d in domains:
        for split in ("train", "valid"):
            p = zoo / "data" / d / f"{split}.txt"
            if not p.is_file():
                raise MoetoolError(f"{p}: zoo text missing; rebuild the zoo (`moetool zoo build --force`)")
            texts[d, split] = p.read_text(encoding="utf-8")
    return texts


def _train_and_save(
    zoo: Path, out: Path, cfg: MambaZooConfig, texts: dict[tuple[str, str], str], console: Console
) -> dict[str, Any]:
    """Train the Mamba on the zoo's balanced domain mix, evaluate it, save it into ``out``; returns mamba.json."""
    from transformers import AutoTokenizer, MambaForCausalLM

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(zoo / BASE_NAME))
    streams = [
        torch.tensor(tokenizer(texts[d, "train"], add_special_tokens=False, verbose=False)["input_ids"])
        for d in DOMAINS
    ]
    torch.manual_seed(derive_seed(cfg.seed, "mamba"))
    model = MambaForCausalLM(mamba_config(cfg, tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"zoo mamba: {cfg.num_layers} layers, hidden {cfg.hidden_size}, state {cfg.state_size}, "
        f"{n_params / 1e6:.2f}M params, {cfg.steps} steps on {cfg.num_threads} thread(s)"
    )
    probe = torch.randint(0, len(tokenizer), (2, 48), generator=torch.Generator().manual_seed(0))
    scan_diff = check_fast_scan(model, probe)
    with patched_scan():
        stats = train_zoo_model(
            model,
            console=console,
            name=MAMBA_NAME,
            streams=streams,
            mix=list(range(len(DOMAINS))),
            steps=cfg.steps,
            lr=cfg.lr,
            cfg=cfg,
            bos_id=int(tokenizer.bos_token_id),
        )
    scan_diff = max(scan_diff, check_fast_scan(model, probe))
    with patched_scan():
        ppl = {
            d: perplexity(model, tokenizer, texts[d, "valid"], seq_len=cfg.seq_len, max_tokens=cfg.eval_max_tokens)
            for d in DOMAINS
        }
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    meta = {
        "config": asdict(cfg),
        "architecture": "MambaForCausalLM",
        "parameters": n_params,
        "tokenizer": str(zoo / BASE_NAME),
        "training": stats,
        "perplexity": {d: round(v, 4) for d, v in ppl.items()},
        "eval_max_tokens": cfg.eval_max_tokens,
        "fast_scan_max_abs_logit_diff": scan_diff,
        "build_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / MAMBA_JSON).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def build_zoo_mamba(
    profile: str = "default",
    *,
    config: MambaZooConfig | None = None,
    force: bool = False,
    console: Console | None = None,
    root: Path | None = None,
) -> Path:
    """Train (or find cached) the zoo Mamba expert of ``profile``; returns its directory ``<zoo>/mamba``.

    Raises:
        MoetoolError: the zoo is not built, or training diverged.
    """

    cfg = config or MambaZooConfig()
    console = console or Console(stderr=True)
    zoo = Path(root) if root is not None else zoo_dir(profile)
    out = zoo / MAMBA_NAME
    meta_path = out / MAMBA_JSON
    if meta_path.is_file() and not force:
        meta = json.loads(meta_path.read_text())
        if meta.get("config") == asdict(cfg):
            console.print(f"[green]zoo mamba[/] {out} is up to date")
            return out
    texts = _zoo_texts(zoo, DOMAINS)
    if not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise MoetoolError(f"lr must be a positive number, got {cfg.lr}")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    remove_stale_builds(out)
    try:
        # force: an outdated or partial <zoo>/mamba is ours to replace
        with atomic_dir(out, force=True) as tmp, quiet_transformers():
            meta = _train_and_save(zoo, tmp, cfg, texts, console)
    finally:
        torch.set_num_threads(threads)
    ppl_line = ", ".join(f"{d} {v:.1f}" for d, v in meta["perplexity"].items())
    console.print(
        f"[green]zoo mamba built[/] in {meta['build_seconds']:.0f} s -> {out} (held-out perplexity {ppl_line})"
    )
    return out


if __name__ == "__main__":  # pragma: no cover - `python -m moetool.methods.hybrid.zoo_mamba [--force]`
    import sys

    build_zoo_mamba(force="--force" in sys.argv)
