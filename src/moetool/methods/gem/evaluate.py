"""GEM evaluation: GG, CDTR and DSI for the GEM model, the general model and each domain expert on held-out text,
and the fallback experiment (the same GEM model at tau = 0, i.e. never falling back, at its tau, and at tau = 1,
i.e. always general).

Perf = 1 / perplexity as in :mod:`moetool.eval.gem`. Sequence-level bundles are scored per window: each window is
routed once and scored by the chosen pathway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

import gc
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetool.eval.gem import gem_metrics
from moetool.eval.perplexity import load_causal_lm, token_nll
from moetool.io.safe import read_json
from moetool.methods.gem.model import decide
from moetool.methods.gem.router import hf_encoder


class _AtTau(nn.Module):
    """A ``moetool_gem`` model called at a fixed threshold; records the routes of every call."""

    def __init__(self, model: Any, tau: float) -> None:
        super().__init__()
        self.inner, self.tau = model, tau
        self.routes: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor) -> Any:
        out = self.inner(input_ids, tau=self.tau)
        self.routes.append(out.routes.reshape(-1))
        return out


class SequenceGem(nn.Module):
    """A sequence-level bundle as one model: route each row once (router on the general model's first layers,
    mean-pooled), then return the chosen pathway's logits. input_ids [B, T] → .logits [B, T, V]."""

    def __init__(self, bundle: Path, tau: float | None = None) -> None:
        super().__init__()
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        spec = read_json(bundle / "gem.json", what="GEM bundle spec")
        self.names = ["general", *spec["domains"]]
        self.tau = spec["tau"] if tau is None else tau
        self.pathways = nn.ModuleList(
            [
                AutoModelForCausalLM.from_pretrained(str(bundle / spec["pathways"][n]), dtype=torch.float32).eval()
                for n in self.names
            ]
        )
        w = load_file(str(bundle / spec["router"]))
        self.router = nn.Linear(w["weight"].shape[1], w["weight"].shape[0])
        self.router.load_state_dict(w)
        self.featurize = hf_encoder(self.pathways[0], spec["encoder"]["layers"])
        self.routes: list[torch.Tensor] = []

    @torch.no_grad()
    def route(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(P(d|x) [B, n], route [B]) for each row."""

        probs = torch.softmax(self.router(self.featurize(input_ids).mean(1)).float(), -1)
        return probs, decide(probs, self.tau)

    def forward(self, input_ids: torch.Tensor) -> Any:
        from transformers.modeling_outputs import CausalLMOutput

        _, route = self.route(input_ids)
        self.routes.append(route.repeat_interleave(input_ids.shape[1]))
        rows = [self.pathways[int(r)](input_ids[i : i + 1]).logits for i, r in enumerate(route)]
        return CausalLMOutput(logits=torch.cat(rows))


def _ppl_row(
    model: Any, tok: PreTrainedTokenizerBase, texts: Mapping[str, str], seq_len: int, max_tokens: int
) -> dict[str, float]:
    out = {}
    for d, text in texts.items():
        nll, n = token_nll(model, tok, text, seq_len=seq_len, max_tokens=max_tokens, batch_size=8)
        out[d] = math.exp(nll / n)
    return out


def gem_report(
    gem_dir: Path,
    general: Path,
    experts: Mapping[str, Path],
    texts: Mapping[str, str],
    *,
    seq_len: int = 256,
    max_tokens: int = 8192,
) -> dict[str, Any]:
    """Perplexity, routing shares and GEM metrics of: the GEM model at tau 0 / its tau / 1, the general model and
    every expert, on each domain's held-out text; plus the experiment summary (see :func:`fallback_experiment`)."""
    from transformers import AutoTokenizer

    import moetool.methods.gem.model  # noqa: F401  (registers its model class)

    tok = AutoTokenizer.from_pretrained(str(gem_dir))
    bundle = (gem_dir / "gem.json").is_file()
    if bundle:
        base: Any = SequenceGem(gem_dir)
        tau0, names = base.tau, base.names
    else:
        base, _ = load_causal_lm(gem_dir)
        tau0, names = float(base.config.tau), ["general", *base.config.domains]
    out: dict[str, Any] = {
        "settings": {
            "seq_len": seq_len,
            "max_tokens": max_tokens,
            "tau": tau0,
            "level": "sequence" if bundle else "token",
        },
        "perplexity": {},
        "routing": {},
        "gem": {},
    }
    variants = {f"gem (tau={tau0:g})": tau0, "gem, no fallback (tau=0)": 0.0, "gem, all general (tau=1)": 1.0}
    for label, tau in variants.items():
        row: dict[str, float] = {}
        shares: dict[str, dict[str, float]] = {}
        for d, text in texts.items():
            if bundle:
                base.tau, base.routes = tau, []
                m: Any = base
            else:
                m = _AtTau(base, tau)
            row |= _ppl_row(m, tok, {d: text}, seq_len, max_tokens)
            routes = torch.cat(m.routes)
            counts = torch.bincount(routes, minlength=len(names)).float() / routes.numel()
            shares[d] = {n: round(float(c), 4) for n, c in zip(names, counts, strict=True)}
        out["perplexity"][label] = row
        out["routing"][label] = shares
        out["gem"][label] = gem_metrics({d: 1 / p for d, p in row.items()}, None)
    del base
    gc.collect()
    for label, path, own in [("general", general, None), *[(f"expert {d}", p, d) for d, p in experts.items()]]:
        model, mtok = load_causal_lm(path)
        out["perplexity"][label] = _ppl_row(model, mtok, texts, seq_len, max_tokens)
        out["gem"][label] = gem_metrics({d: 1 / p for d, p in out["perplexity"][label].items()}, own)
        del model
        gc.collect()
    out["experiment"] = fallback_experiment(out, f"gem (tau={tau0:g})", list(experts))
    return out


def fallback_experiment(report: Mapping[str, Any], gem_label: str, domains: list[str]) -> dict[str, Any]:
    """Per domain d: the expert's GG on d against GEM's GG with d as its own domain, and in-domain perplexity of the
    expert vs GEM (and of GEM without the fallback). ``gg_reduced``: GEM's gap is smaller; ``in_domain_loss``: GEM's
    in-domain perplexity over the expert's, minus 1 (positive = GEM is worse in-domain)."""
    ppl = report["perplexity"]
    nofb = next(k for k in ppl if "no fallback" in k)
    rows = {}
    for d in domains:
        e = f"expert {d}"
        gg_e = report["gem"][e]["gg"]
        gg_g = report["gem"][gem_label]["gg_per_domain"][d]
        gg_n = report["gem"][nofb]["gg_per_domain"][d]
        rows[d] = {
            "gg_expert": round(gg_e, 4),
            "gg_gem": round(gg_g, 4),
            "gg_gem_no_fallback": round(gg_n, 4),
            "gg_reduced": gg_g < gg_e,
            "ppl_in_domain_expert": round(ppl[e][d], 3),
            "ppl_in_domain_gem": round(ppl[gem_label][d], 3),
            "ppl_in_domain_no_fallback": round(ppl[nofb][d], 3),
            "in_domain_loss": round(ppl[gem_label][d] / ppl[e][d] - 1, 4),
            "ppl_out_of_domain_expert": round(sum(v for k, v in ppl[e].items() if k != d) / (len(ppl[e]) - 1), 3),
            "ppl_out_of_domain_gem": round(
                sum(v for k, v in ppl[gem_label].items() if k != d) / (len(ppl[gem_label]) - 1), 3
            ),
        }
    return rows
