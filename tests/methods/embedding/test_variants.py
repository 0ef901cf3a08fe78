"""Routed-embedding modules: shapes, normalisation, causality, cache, closed-form parameter counts."""

from __future__ import annotations

import pytest
import torch

from moetool.methods.embedding.router import CausalRouter, RouterConfig, causal_mask, router_param_count
from moetool.methods.embedding.variants import (
    EmbeddingConfig,
    RoutedEmbedding,
    embedding_args,
    measured_counts,
    param_counts,
)

torch.set_num_threads(1)  # the CPU is shared; tiny models gain nothing from more threads

ROUTER = {"width": 16, "layers": 2, "heads": 4, "n_queries": 3}
CASES = {
    "generative": {},
    "remix": {},
    "selection": {},
    "remix-top2": {"top_k": 2},
    "dense": {},
    "dense-depth": {"depth": 2},
}


def make(name: str, **kw: object) -> RoutedEmbedding:
    torch.manual_seed(0)
    variant = name.split("-", maxsplit=1)[0]
    args = {"n_experts": 4, "top_k": 4} | CASES[name] | kw
    cfg = EmbeddingConfig(
        variant=variant,
        vocab_size=40,
        d_model=24,
        seed_dim=8,
        pool_dim=32,
        mask_hidden=8,
        router=ROUTER,
        max_positions=64,
        **args,
    )  # type: ignore[arg-type]
    m = RoutedEmbedding(cfg).eval()
    with torch.no_grad():  # away from the init's special points (zero generator, 0.5 masks), so every path is live
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def run(m: RoutedEmbedding, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    with torch.no_grad():
        return m(ids, torch.arange(t)[None].expand(b, t), causal_mask(t, 0, b))[0]


@pytest.mark.parametrize("name", list(CASES))
def test_shapes_and_aux(name):
    m = make(name)
    ids = torch.randint(0, 40, (3, 11))
    h, present, aux = m(ids, torch.arange(11)[None].expand(3, 11), causal_mask(11, 0, 3))
    assert h.shape == (3, 11, 24)
    assert len(present) == m.n_cache
    assert torch.isfinite(aux["total"])
    if name.startswith(("remix", "selection")):
        assert set(aux) == {"balance", "z", "diversity", "total"}
        assert 0 <= float(aux["diversity"].detach()) <= 1


@pytest.mark.parametrize("name", list(CASES))
def test_causal_every_variant(name):
    """Changing tokens after position i leaves positions ≤ i unchanged (and changes later ones)."""
    m = make(name)
    ids = torch.randint(0, 40, (2, 16))
    ref = run(m, ids)
    for i in (0, 5, 14):
        other = ids.clone()
        other[:, i + 1 :] = (other[:, i + 1 :] + 7) % 40
        got = run(m, other)
        torch.testing.assert_close(got[:, : i + 1], ref[:, : i + 1], atol=1e-6, rtol=0)
        assert (got[:, i + 1 :] - ref[:, i + 1 :]).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_cached_equals_uncached(name):
    m = make(name)
    ids = torch.randint(0, 40, (2, 13))
    ref = run(m, ids)
    with torch.no_grad():
        out, past = [], ()
        for start, stop in ((0, 5), (5, 6), (6, 7), (7, 13)):  # a prefill, single tokens, then a chunk
            t = stop - start
            pos = (torch.arange(t) + start)[None].expand(2, t)
            h, past, _ = m(ids[:, start:stop], pos, causal_mask(t, start, 2), past)
            out.append(h)
    torch.testing.assert_close(torch.cat(out, 1), ref, atol=1e-5, rtol=1e-5)
    if m.n_cache:  # the router's cache grows by the new tokens only
        assert past[0].shape[2] == 13


def test_remix_rows_sum_to_one():
    m = make("remix")
    u = torch.randn(2, 5, 8)
    s = m.remix_matrices(u)
    assert s.shape == (2, 5, 4, 8, 8)
    torch.testing.assert_close(s.sum(-1), torch.ones(2, 5, 4, 8))
    assert (s >= 0).all()


@pytest.mark.parametrize("name", ["remix", "selection", "remix-top2"])
def test_router_weights_sum_to_one(name):
    m = make(name)
    w = m.routing_weights(torch.randint(0, 40, (3, 9)))
    assert w.shape == (3, 9, 4)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 9))
    assert (w >= 0).all()
    if name == "remix-top2":
        assert ((w > 0).sum(-1) == 2).all()


def test_full_top_k_is_dense_soft_mixing():
    """top_k = K equals a plain softmax over the tempered blended logits."""
    m = make("remix")
    r = m.router
    assert r is not None
    ids = torch.randint(0, 40, (2, 7))
    pos = torch.arange(7)[None].expand(2, 7)
    with torch.no_grad():
        h, c, _ = r(m.seed(ids), pos, causal_mask(7, 0, 2))
        logits, w = r.route(h, c, pos)
        tau = torch.exp(r.log_tau[pos])[..., None]
    torch.testing.assert_close(w, torch.softmax(logits / tau, -1))


@pytest.mark.parametrize("name", list(CASES))
def test_param_counts_closed_form(name):
    m = make(name)
    closed = param_counts(m.cfg)
    assert closed == measured_counts(m)
    assert closed["total"] == sum(p.numel() for p in m.parameters())


def test_router_closed_form_and_errors():
    cfg = RouterConfig(
        in_dim=8, width=16, layers=3, heads=2, ff_mult=3, n_queries=5, n_experts=6, top_k=2, max_positions=20
    )
    assert router_param_count(cfg) == sum(p.numel() for p in CausalRouter(cfg).parameters())
    with pytest.raises(ValueError, match="divisible"):
        CausalRouter(RouterConfig(in_dim=8, width=10, heads=4))
    with pytest.raises(ValueError, match="top_k"):
        CausalRouter(RouterConfig(in_dim=8, width=8, heads=2, n_experts=2, top_k=3))


def test_paper_closed_form_remix():
    """Remix with one linear d → d² per expert: (d + 1)·d² per expert, as the notes' arithmetic for Table 4."""
    cfg = EmbeddingConfig(variant="remix", vocab_size=50257, d_model=512, seed_dim=64, n_experts=8)
    assert param_counts(cfg)["experts"] == 8 * 65 * 64 * 64
    assert param_counts(cfg)["table"] == 50257 * 64


def test_balance_and_z_behave():
    """The balance loss is 1 at uniform routing and grows when one expert takes all; z grows with logit scale."""
    from moetool.routing.losses import load_balancing_loss, router_z_loss

    uniform = torch.zeros(64, 4) + torch.randn(64, 4) * 1e-4
    skewed = torch.zeros(64, 4)
    skewed[:, 0] = 10
    assert float(load_balancing_loss(uniform, 4)) == pytest.approx(1.0, abs=1e-3)
    assert float(load_balancing_loss(skewed, 1)) > 3.5
    assert float(router_z_loss(uniform * 1e3 + 5)) > float(router_z_loss(uniform))


def test_embedding_args_checks_each_setting() -> None:
    kw = {"variant": "remix", "seed_dim": 8, "dropout": 0, "router": {"width": 16}, "aux": {"z": 1}}
    args = embedding_args(kw)
    assert args == {"variant": "remix", "seed_dim": 8, "dropout": 0.0, "router": {"width": 16}, "aux": {"z": 1.0}}
    assert isinstance(args["dropout"], float)
    for bad in ({"seed_dim": True}, {"seed_dim": "8"}, {"variant": None}, {"router": 3}, {"vocab": 8}):
        with pytest.raises(ValueError, match=rf"embedding: {next(iter(bad))}: not an embedding setting"):
            embedding_args(bad)
