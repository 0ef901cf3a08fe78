"""The routed-embedding model: retrofit at step 0, cached decoding, save/load, frozen-body training, the recipe and
``moetool merge``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import TEXT, dense_config, save_dense
from moetool.errors import OutputExistsError, RecipeError
from moetool.methods.embedding.model import RoutedEmbeddingForCausalLM
from moetool.methods.embedding.retrofit import TrainSettings, retrofit, svd_seed, train_embedding

torch.set_num_threads(1)  # the CPU is shared; tiny models gain nothing from more threads

ROUTER = {"width": 16, "layers": 2, "heads": 4, "n_queries": 2}


def emb(variant: str, **kw: object) -> dict[str, object]:
    return {
        "variant": variant,
        "seed_dim": 8,
        "pool_dim": 16,
        "mask_hidden": 8,
        "n_experts": 4,
        "top_k": 4,
        "router": ROUTER,
    } | kw


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_dense(tmp_path_factory.mktemp("emb") / "base")


def load(path: Path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def svd_approx(e: torch.Tensor, r: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(e.double(), full_matrices=False)
    return ((u[:, :r] * s[:r]) @ vh[:r]).float()


@pytest.mark.parametrize("variant", ["generative", "dense", "selection"])
def test_step0_equals_svd_approximation(tiny, variant):
    """The retrofitted model at step 0 is the original body fed the rank-r SVD approximation of its table."""
    src = load(tiny)
    e = src.get_input_embeddings().weight.detach()
    m = retrofit(src, emb(variant)).eval()
    r = 6 if variant == "generative" else 8
    ids = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        got = m(ids).logits
        ref = src(inputs_embeds=svd_approx(e, r)[ids]).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # and it is not trivially the original (rank 6-8 of 32 loses something)
        assert (got - src(ids).logits).abs().max() > 1e-2


def test_svd_seed_on_layernorm_sphere():
    e = torch.randn(50, 20)
    table, proj, r = svd_seed(e, 10, on_layernorm_sphere=True)
    assert r == 8
    torch.testing.assert_close(table.mean(-1), torch.zeros(50), atol=1e-5, rtol=0)
    torch.testing.assert_close(table.pow(2).mean(-1), torch.ones(50), atol=1e-4, rtol=0)
    ln = torch.nn.functional.layer_norm(table, (10,), eps=1e-5)
    torch.testing.assert_close(ln @ proj.T, svd_approx(e, 8), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rank"):
        svd_seed(e, 2, on_layernorm_sphere=True)


def test_seed_head_is_svd_of_tied_head(tmp_path):
    """head: seed ties the output head to the seed table through the projection: at step 0 it is E_r too."""
    base = save_dense(tmp_path / "tied", tie_word_embeddings=True)
    src = load(base)
    e = src.get_input_embeddings().weight.detach()
    m = retrofit(src, emb("generative"), head="seed").eval()
    assert m.lm_head is None
    er = svd_approx(e, 6)
    ids = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        h = src.model(inputs_embeds=er[ids]).last_hidden_state
        torch.testing.assert_close(m(ids).logits, h @ er.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["generative", "remix", "selection"])
def test_cached_decoding_equals_full_forward(tiny, variant):
    m = retrofit(load(tiny), emb(variant)).eval()
    with torch.no_grad():
        for p in m.embed.parameters():  # trained-looking weights: the generator and masks away from zero
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 320, (2, 14))
    with torch.no_grad():
        full = m(ids).logits
        logits, state = m.step(ids[:, :6])
        steps = [logits]
        for t in range(6, 14):
            logits, state = m.step(ids[:, t : t + 1], state)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    assert state.length == 14 and state.router[0].shape[2] == 14
    with pytest.raises(ValueError, match="pad on the right"):
        m(ids[:1, :4], attention_mask=torch.tensor([[0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="max_positions"):
        m(torch.zeros(1, 129, dtype=torch.long))
    out = m.greedy(ids[:1, :4], 5)
    assert out.shape == (1, 9) and torch.equal(out[:, :4], ids[:1, :4])


def test_mixtral_body(tmp_path):
    """A merged MoE (Mixtral) body works the same way: retrofit, cached == full."""
    import transformers

    cfg = dense_config(num_local_experts=3, num_experts_per_tok=2)
    mcfg = transformers.MixtralConfig(
        **{
            k: getattr(cfg, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
            )
        },
        num_local_experts=3,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    src = transformers.MixtralForCausalLM(mcfg).eval()
    m = retrofit(src, emb("remix")).eval()
    assert type(m.body).__name__ == "MixtralModel"
    ids = torch.randint(0, 320, (1, 10))
    with torch.no_grad():
        full = m(ids).logits
        a, st = m.step(ids[:, :7])
        b, _ = m.step(ids[:, 7:], st)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head", ["keep", "seed"])
def test_save_load_safetensors(tiny, tmp_path, head):
    m = retrofit(load(tiny), emb("generative"), head=head).eval()
    m.save_pretrained(str(tmp_path / "m"))
    assert not list((tmp_path / "m").glob("*.bin"))
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any("embed_tokens" in n for n in names)  # the V×D input table is gone
    assert ("lm_head.weight" in names) == (head == "keep")
    again = load(tmp_path / "m")
    assert isinstance(again, RoutedEmbeddingForCausalLM) and again.config.head == head
    ids = torch.randint(0, 320, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, m(ids).logits, atol=0, rtol=0)


def test_training_freezes_body_and_lowers_loss(tiny):
    src = load(tiny)
    old = src.get_input_embeddings().weight.detach().clone()
    m = retrofit(src, emb("generative"))
    body = {k: v.clone() for k, v in m.body.state_dict().items()}
    head = m.lm_head.weight.detach().clone()
    data = torch.randint(0, 320, (64, 16))

    def batches(step: int) -> torch.Tensor:
        return data[(step * 4) % 64 : (step * 4) % 64 + 4]

    def loss() -> float:
        with torch.no_grad():
            return float(m(data, labels=data).loss)

    before = loss()
    s = TrainSettings(steps=15, learning_rate=1e-2, warmup_steps=2, log_every=5)
    train_embedding(m, old, batches, s)
    assert loss() < before
    assert all(torch.equal(v, m.body.state_dict()[k]) for k, v in body.items())
    assert torch.equal(head, m.lm_head.weight)
    assert [h["step"] for h in s.history] == [5, 10, 15]
    assert float(m.embed.gen.weight.abs().max()) > 0  # the generator left zero


RECIPE = """\
name: tiny-emb
method: embedding
model: {model}
head: keep
embedding:
  variant: generative
  seed_dim: 8
  router: {{width: 16, layers: 1, heads: 4, n_queries: 2}}
train:
  data:
    mixed: {{text: data.txt}}
  steps: 4
  batch_size: 2
  seq_len: 16
"""


def test_merge_builds_and_checks(tiny, tmp_path):
    from moetool.api import assemble

    (tmp_path / "data.txt").write_text("\n\n".join([TEXT] * 6))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(model=tiny))
    out = assemble(recipe, tmp_path / "out")
    meta = json.loads((out / "moetool.json").read_text())["embedding"]
    assert meta["step0"]["max_abs_vs_svd"] < 1e-5 and meta["step0"]["svd_rank"] == 6
    assert meta["cached_vs_full_max_abs_logit_diff"] < 1e-4 and meta["reload_max_abs_logit_diff"] == 0
    assert set(meta["heldout_perplexity"]["mixed"]) == {"original", "retrofitted"}
    assert meta["params"]["head"] == 320 * 32 and meta["params"]["original_table"] == 320 * 32
    assert isinstance(load(out), RoutedEmbeddingForCausalLM)
    assert (out / "tokenizer.json").is_file() and (out / "moetool-recipe.yaml").is_file()
    from moetool.eval.report import evaluate  # what `moetool eval` runs: the built model is a first-class citizen

    ppl = evaluate({"emb": out}, {"mixed": TEXT}, seq_len=16, max_tokens=64)["perplexity"]["emb"]["mixed"]
    assert 1 < ppl < 1e4
    with pytest.raises(OutputExistsError):
        assemble(recipe, tmp_path / "out")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t.replace("seed_dim: 8", "seed_dim: 8\n  colour: red"), "embedding.colour: unknown key"),
        (
            lambda t: t.replace("variant: generative", "variant: selection").replace("head: keep", "head: seed"),
            "head: 'seed' needs a seed table",
        ),
        (lambda t: t.replace("seed_dim: 8", "seed_dim: 8\n  n_experts: 2\n  top_k: 3"), "embedding.top_k: 3 is larger"),
        (lambda t: t.replace("heads: 4", "heads: 5"), "embedding.router.heads: 5 does not divide"),
    ],
)
def test_recipe_errors_name_field_and_line(tmp_path, edit, expected):
    from moetool.recipe import load_recipe

    p = tmp_path / "bad.yaml"
    p.write_text(edit(RECIPE.format(model="zoo:base")))
    with pytest.raises(RecipeError) as info:
        load_recipe(p)
    assert expected in str(info.value) and f"{p}:" in str(info.value)


def test_missing_model_is_named(tmp_path):
    from moetool.api import assemble
    from moetool.errors import PreflightError

    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(model=tmp_path / "nope"))
    with pytest.raises(PreflightError, match="^model: "):
        assemble(recipe, tmp_path / "out")


def test_dry_run_describes_parameters(tiny, tmp_path):
    from moetool.methods.embedding.assemble import EmbeddingAssembler
    from moetool.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(model=tiny))
    plan = EmbeddingAssembler().describe(load_recipe(recipe), recipe_dir=tmp_path)
    assert plan.method == "embedding" and plan.inputs == {"model": str(tiny)}
    assert plan.parameters["input table"] == 10_240 and plan.parameters["output head"] == 10_240
    assert 0 < plan.parameters["routed embedding"] < 10_240
    text = plan.render()
    assert "original input table 10,240 params" in text and "head: 10,240 params" in text.replace("output head", "head")
    assert "variant generative, seed_dim 8, head keep" in text


def test_unfreeze_phase_trains_the_body(tiny):
    src = load(tiny)
    m = retrofit(src, emb("dense"))
    body = {k: v.clone() for k, v in m.body.state_dict().items()}
    data = torch.randint(0, 320, (8, 16))
    s = TrainSettings(steps=2, unfreeze_steps=2, unfreeze_learning_rate=1e-3, warmup_steps=0, log_every=1)
    train_embedding(m, src.get_input_embeddings().weight.detach(), lambda step: data, s)
    assert [h["step"] for h in s.history] == [1, 2, 3, 4]
    assert any(not torch.equal(v, m.body.state_dict()[k]) for k, v in body.items())
    assert not any(p.requires_grad for p in m.parameters())  # left frozen for inference
