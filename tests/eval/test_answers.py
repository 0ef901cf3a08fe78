"""Questions through the chat template: the greedy answer equals a direct argmax loop, the expert shares equal a
count of the routers' top-k choices, and a tokenizer without a template is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import write_recipe
from moetool.api import merge
from moetool.errors import MoetoolError
from moetool.eval.answers import answer_shares, ask, chat_prompt_ids
from moetool.routing.tap import RouterTap

TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"


@pytest.fixture(scope="module")
def moe(tiny_models, tmp_path_factory):
    m = tiny_models("llama")
    tmp = tmp_path_factory.mktemp("ask")
    text = (
        f"name: askme\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\nexperts:\n"
        f"  - {{name: code, source: {m['e1']}, positive_prompts: ['def main():']}}\n"
        f"  - {{name: legal, source: {m['e2']}, positive_prompts: ['Permission is hereby granted']}}\n"
        f"  - {{name: medical, source: {m['e3']}, positive_prompts: ['acute bronchitis']}}\n"
    )
    out = merge(write_recipe(tmp / "r.yaml", text), tmp / "moe")
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out


def _argmax_loop(model, prompt, n, stop):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if nxt in stop:
                break
            ids.append(nxt)
    return ids[len(prompt) :]


def test_answer_is_the_greedy_continuation_with_counted_shares(moe):
    answers = ask(moe, {"code": "def main():", "medical": "acute bronchitis"}, max_new_tokens=12)
    model = AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(moe))
    assert [a.label for a in answers] == ["code", "medical"]
    for a in answers:
        assert a.prompt_ids == chat_prompt_ids(tok, a.question)
        assert a.ids == _argmax_loop(model, a.prompt_ids, 12, a.stop_ids)
        assert a.text == tok.decode(a.ids, skip_special_tokens=True).strip()
        assert set(a.shares) == {"code", "legal", "medical"}
        assert sum(a.shares.values()) == pytest.approx(1.0, abs=1e-3)
        # the shares count top-2 choices at the positions that predicted the answer, over every layer
        tap = RouterTap(model)
        with torch.no_grad():
            model(torch.tensor([a.prompt_ids + a.ids[:-1]]))
        tap.remove()
        start = len(a.prompt_ids) - 1
        chosen = torch.cat([lg[start:].topk(2, dim=-1).indices.flatten() for lg in tap.logits])
        want = torch.bincount(chosen, minlength=3).float() / chosen.numel()
        assert [a.shares[n] for n in ("code", "legal", "medical")] == pytest.approx(want.tolist(), abs=1e-3)
        assert answer_shares(model, a.prompt_ids, a.ids, ["code", "legal", "medical"]) == a.shares


def test_a_tokenizer_without_chat_template_is_refused(tiny_models):
    tok = AutoTokenizer.from_pretrained(str(tiny_models("llama")["base"]))
    with pytest.raises(MoetoolError, match="no chat template"):
        chat_prompt_ids(tok, "hello")


def test_a_dense_model_answers_without_shares(tiny_models, tmp_path):
    import shutil

    base = shutil.copytree(tiny_models("llama")["base"], tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(base))
    (a,) = ask(base, {"q": "hello"}, max_new_tokens=4)
    assert a.shares == {} and len(a.ids) <= 4


def test_a_qwen2_moe_answers_with_its_expert_names(tiny_models, tmp_path):
    """Qwen MoE configs count experts as ``num_experts`` (Mixtral: ``num_local_experts``)."""
    m = tiny_models("qwen2")
    text = (
        f"name: askq\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\nexperts:\n"
        f"  - {{name: code, source: {m['e1']}, positive_prompts: ['def main():']}}\n"
        f"  - {{name: legal, source: {m['e2']}, positive_prompts: ['Permission is hereby granted']}}\n"
    )
    out = merge(write_recipe(tmp_path / "r.yaml", text), tmp_path / "moe")
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    (a,) = ask(out, {"q": "def main():"}, max_new_tokens=4)
    assert set(a.shares) == {"code", "legal"} and sum(a.shares.values()) == pytest.approx(1.0, abs=1e-3)
