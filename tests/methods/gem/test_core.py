"""GEM building blocks without checkpoints: the threshold rule, SCAR's mask, the quantizer, the recipe's errors."""

from __future__ import annotations

import pytest
import torch

from moetool.errors import RecipeError
from moetool.methods.gem.model import decide
from moetool.methods.gem.qat import fake_quant, kd_loss, quant_penalty
from moetool.methods.gem.router import tau_table
from moetool.methods.gem.scar import (
    assign_clusters,
    clustered_attention,
    kmeans_cosine,
    masked_attention,
    multiplicative_scores,
    scar_mask,
    scar_score_entries,
)
from moetool.recipe.load import parse_recipe


def test_tau_boundary_is_strict():
    # float32 0.7 against tau 0.7: not greater, so general (route 0); a hair above goes to the argmax domain
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.7000001, 0.0999999], [0.1, 0.15, 0.75], [0.4, 0.3, 0.3]])
    assert decide(probs, 0.7).tolist() == [0, 2, 3, 0]
    assert decide(probs, 0.0).tolist() == [1, 2, 3, 1]  # tau 0: always a domain
    assert decide(probs, 1.0).tolist() == [0, 0, 0, 0]  # tau 1: always general
    assert decide(torch.rand(2, 5, 3).softmax(-1), 0.7).shape == (2, 5)


def test_tau_table_counts():
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.75, 0.2, 0.05]])
    labels = torch.tensor([0, 0, 1, 2])
    t = tau_table(probs, labels, [0.0, 0.7], ["a", "b", "c"])
    assert t["argmax_accuracy"] == 0.75
    r0, r7 = t["by_tau"]
    assert r0 == {
        "tau": 0.0,
        "fallback": 0.0,
        "routed_accuracy": 0.75,
        "correct": 0.75,
        "wrong": 0.25,
        "fallback_by_domain": {"a": 0.0, "b": 0.0, "c": 0.0},
    }
    # 0.6 falls back; 0.9 and 0.8 are right, 0.75 (true c) is routed to a: wrong
    assert r7["fallback"] == 0.25 and r7["routed_accuracy"] == round(2 / 3, 4) and r7["wrong"] == 0.25
    assert r7["fallback_by_domain"] == {"a": 0.5, "b": 0.0, "c": 0.0}


def _qkv(b: int = 2, h: int = 2, t: int = 24, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(3))


def test_additive_mask_equals_attention_restricted_to_the_cluster():
    q, k, v = _qkv()
    labels = torch.randint(0, 4, (2, 24), generator=torch.Generator().manual_seed(1))
    dense = masked_attention(q, k, v, scar_mask(labels, dtype=torch.float64))
    sparse = clustered_attention(q, k, v, labels)
    torch.testing.assert_close(dense, sparse, rtol=0, atol=1e-12)
    # and it is not full causal attention
    causal = torch.full((24, 24), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    assert (masked_attention(q, k, v, causal) - dense).abs().max() > 1e-3


def test_mask_is_causal_and_same_cluster_only():
    labels = torch.tensor([[0, 1, 0, 1, 1]])
    m = scar_mask(labels)[0, 0]
    allowed = (m == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [0, 1, 0, 1, 1]]
    assert torch.isinf(m[m != 0]).all()


def test_paper_multiplicative_mask_leaks_across_clusters():
    q, k, _ = _qkv(b=1, h=1, t=6)
    labels = torch.tensor([[0, 1, 0, 1, 0, 1]])
    scores = torch.matmul(q, k.transpose(-1, -2))
    paper = torch.softmax(multiplicative_scores(scores, labels), -1)
    ours = torch.softmax(scores + scar_mask(labels, dtype=scores.dtype), -1)
    cross = (labels[:, :, None] != labels[:, None, :])[:, None]
    assert paper[cross].min() > 0  # exp(0) = 1: every cross-cluster pair keeps weight
    assert ours[cross].max() == 0


def test_kmeans_cosine_recovers_directions_and_counts_entries():
    g = torch.Generator().manual_seed(0)
    dirs = torch.eye(4)[:3] * 5
    pts = torch.cat([d + 0.3 * torch.randn(30, 4, generator=g) for d in dirs])
    mu = kmeans_cosine(pts, 3, iterations=10)
    labels = assign_clusters(pts, mu)
    groups = [set(labels[i * 30 : (i + 1) * 30].tolist()) for i in range(3)]
    assert all(len(s) == 1 for s in groups) and len(set.union(*groups)) == 3
    # scale does not change a cosine assignment
    assert torch.equal(assign_clusters(pts * 7, mu), labels)
    assert scar_score_entries(torch.tensor([[0, 0, 1, 1, 1]])) == 3 + 6
    with pytest.raises(ValueError, match="cannot make"):
        kmeans_cosine(pts[:2], 3)


def test_fake_quant_levels_and_error_scaling():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    errs = {}
    for bits in (4, 6, 8):
        q = fake_quant(w, bits)
        assert q.shape == w.shape
        for blk in q.reshape(-1, 32):
            assert blk.unique().numel() <= 2**bits
        errs[bits] = float((w - q).pow(2).mean())
    # uniform quantization noise falls about 4x per extra bit (GEM's Thm 2 says 1/b^2; that is not what happens)
    assert 8 < errs[4] / errs[6] < 32 and 8 < errs[6] / errs[8] < 32
    # a row length that 32 does not divide is padded, not refused
    assert fake_quant(torch.randn(3, 40), 4).shape == (3, 40)
    assert float(quant_penalty({"w": torch.nn.Parameter(fake_quant(w, 4))}, {"w": 4}).detach()) < 1e-10


def test_kd_loss_zero_for_identical_logits_positive_otherwise():
    a = torch.randn(2, 5, 11)
    assert float(kd_loss(a, a, 2.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(kd_loss(a, a.flip(-1), 2.0)) > 0.01


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t.replace("name: code", "name: general"), "domains.0.name: 'general' is the fallback"),
        (lambda t: t.replace("tau: 0.7", "tau: 1.5"), "router.tau"),
        (lambda t: t.replace("devices: [pixel-6]", "devices: [toaster]"), "devices.0: unknown device 'toaster'"),
        (lambda t: t.replace("level: token", "level: sequence") + "scar:\n  clusters: 4\n", "scar.clusters"),
        (lambda t: t.replace("  seq_len: 32", "  seq_len: 32\n  colour: red"), "router.colour: unknown key"),
    ],
)
def test_recipe_errors_name_the_field_and_line(tmp_path, edit, expected):
    good = (
        "name: g\nmethod: gem\ngeneral: zoo:base\nlevel: token\ndomains:\n  - name: code\n    source: zoo:code\n"
        "    data: {zoo: code}\nrouter:\n  tau: 0.7\n  seq_len: 32\ndevices: [pixel-6]\n"
    )
    assert parse_recipe(good, tmp_path / "g.yaml").router.tau == 0.7
    with pytest.raises(RecipeError, match="g.yaml:") as info:
        parse_recipe(edit(good), tmp_path / "g.yaml")
    assert expected in str(info.value)
