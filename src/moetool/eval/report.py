"""``moetool eval``: perplexity matrix, routing statistics per layer and domain, GEM metrics; JSON and plots."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import torch

from moetool.compute.dtypes import dtype_name
from moetool.compute.upcast import precision_of
from moetool.errors import MoetoolError
from moetool.eval.gem import gem_metrics
from moetool.eval.perplexity import NonFiniteModel, load_causal_lm, nonfinite_weight, token_nll
from moetool.eval.residency import Residency
from moetool.io.safe import read_json
from moetool.routing.tap import RouterTap, has_moe_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MAX_MEAN_NLL = 700.0  # nats per token: math.exp overflows a float64 just past 709


def expert_names(path: str | Path) -> list[str] | None:
    """The expert names a merged model records in its ``moetool.json`` (None where it records none)."""
    meta = Path(path) / "moetool.json"
    names = read_json(meta, what="moetool metadata").get("experts") if meta.is_file() else None
    return [str(x) for x in names] if isinstance(names, list) else None


class RoutingStats(TypedDict):
    """A model's routing on one text, per layer: each expert's share of the top-k choices, mean router entropy (nats)."""

    expert_share: list[list[float]]
    entropy: list[float]


class ModelRecord(TypedDict):
    """What the report says of a model (:func:`_model_record`)."""

    path: str
    moe: bool
    own_domain: str | None
    dtype: str
    arithmetic: str
    device: str
    streamed: NotRequired[str]  # why its layers were streamed from disk, where they were


def _routing_stats(logits_per_layer: list[list[torch.Tensor]], top_k: int) -> RoutingStats:
    """Per layer: share of top-k assignments per expert and mean router entropy (nats)."""
    share: list[list[float]] = []
    entropy: list[float] = []
    for chunks in logits_per_layer:
        x = torch.cat(chunks).float()  # [T, E]
        chosen = x.topk(top_k, dim=-1).indices.reshape(-1)
        share.append((torch.bincount(chosen, minlength=x.shape[-1]).float() / chosen.numel()).tolist())
        logp = x.log_softmax(-1)
        entropy.append(float(-(logp.exp() * logp).sum(-1).mean()))
    return {"expert_share": share, "entropy": entropy}


def _model_record(path: Path, model: PreTrainedModel, own_domain: str | None, held: Residency) -> ModelRecord:
    """What the report says of a model: its path, whether it is an MoE, its own domain, the dtype it is held in and
    the one it computes in (float32 over 16-bit weights where the device has no native 16-bit matmul), its device,
    and, where it did not fit in memory, that its layers were streamed from disk and why."""
    storage, arithmetic = precision_of(model)
    record: ModelRecord = {
        "path": str(path),
        "moe": has_moe_layers(model),
        "own_domain": own_domain,
        "dtype": dtype_name(storage),
        "arithmetic": dtype_name(arithmetic),
        "device": str(model.device),
    }
    if held.streamed:
        record["streamed"] = held.reason
    return record


def _refuse_nonfinite(name: str, path: Path, model: torch.nn.Module) -> None:
    """Refuse a model with a NaN or Inf weight before any figure: a NaN that no text reaches would still leave a
    finite report."""
    bad = nonfinite_weight(model)
    if bad is not None:
        raise NonFiniteModel(
            f"{name}: weight {bad} holds NaN or Inf values; the checkpoint at {path} is corrupt or its training "
            "diverged, so nothing is evaluated"
        )


def evaluate(
    models: Mapping[str, Path],
    texts: Mapping[str, str],
    *,
    own_domains: Mapping[str, str | None] | None = None,
    seq_len: int = 256,
    max_tokens: int | None = 32768,
    batch_size: int = 8,
    also: Callable[[str, PreTrainedModel, PreTrainedTokenizerBase], None] | None = None,
    dtype: str = "auto",
    device: str = "auto",
    residency: Mapping[str, Residency] | None = None,
) -> dict[str, Any]:
    """Evaluate each model on each domain's held-out text; ``also(name, model, tokenizer)`` runs after a model's
    perplexity pass while it is still loaded (lm-eval tasks: each model is read from disk once). Each model runs in
    ``dtype`` (``auto``: its checkpoint's own, nothing upcast) on ``device`` (``auto``: a GPU when there is one),
    resident unless ``residency`` says it is streamed from disk (:func:`moetool.eval.residency.eval_residency`).

    Returns:
        A JSON-ready dict: ``perplexity[model][domain]``, ``nll``/``tokens`` likewise, ``routing[model][domain]``
        (MoE models only: ``expert_share[layer][expert]``, ``entropy[layer]``, ``experts``), ``gem[model]``, and the
        settings.
    """

    own_domains = dict(own_domains or {})
    out: dict[str, Any] = {
        "settings": {"seq_len": seq_len, "max_tokens": max_tokens},
        "domains": list(texts),
        "models": {},
        "perplexity": {},
        "routing": {},
        "gem": {},
    }
    for name, path in models.items():
        held = (residency or {}).get(name) or Residency(streamed=False, batch_size=batch_size)
        model, tok = load_causal_lm(path, dtype=dtype, device=device, streamed=held.streamed)
        _refuse_nonfinite(name, path, model)
        record = _model_record(path, model, own_domains.get(name), held)
        out["models"][name] = record
        tap = RouterTap(model) if record["moe"] else None
        ppl, routing = {}, {}
        try:
            for domain, text in texts.items():
                layer_logits: list[list[torch.Tensor]] = []
                if tap is not None:
                    tap.logits.clear()
                try:
                    nll, n = token_nll(
                        model, tok, text, seq_len=seq_len, max_tokens=max_tokens, batch_size=held.batch_size, tap=tap
                    )
                except ValueError as exc:  # a text too short for one window: name the domain, not the call
                    raise MoetoolError(f"held-out text of {domain!r}: {exc}") from None
                except NonFiniteModel as exc:
                    raise NonFiniteModel(f"{name} on {domain!r}: {exc}; nothing is evaluated") from None
                if nll / n > MAX_MEAN_NLL:  # math.exp would overflow: no perplexity is this large but a broken one
                    raise NonFiniteModel(
                        f"{name} on {domain!r}: a mean loss of {nll / n:.3g} nats per token overflows perplexity; the "
                        "model's logits are broken, so nothing is evaluated"
                    )
                ppl[domain] = math.exp(nll / n)
                if tap is not None:
                    n_layers = len(tap.routers)
                    layer_logits = [tap.logits[i::n_layers] for i in range(n_layers)]
                    routing[domain] = _routing_stats(layer_logits, model.config.num_experts_per_tok)
        finally:
            if tap is not None:
                tap.remove()
        out["perplexity"][name] = ppl
        if routing:
            out["routing"][name] = {"experts": expert_names(path), "per_domain": routing}
        out["gem"][name] = gem_metrics({d: 1.0 / p for d, p in ppl.items()}, own_domains.get(name))
        if also is not None:
            also(name, model, tok)
        del model, tok
        gc.collect()
    return out
