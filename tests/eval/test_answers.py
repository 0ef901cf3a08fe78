"""Questions through the chat template: the greedy answer equals a direct argmax loop, the expert shares equal a
count of the routers' top-k choices, and a tokenizer without a template is refused."""

from __future__ import annotations

import pytest
import torch
from chat_fixtures import add_chat_template, chat_moe
from transformers import AutoModelForCausalLM, AutoTokenizer

from moetool.errors import MoetoolError
from moetool.eval.answers import answer_shares, ask, chat_prompt_ids
from moetool.routing.tap import RouterTap


@pytest.fixture(scope="module")
def moe(tiny_models, tmp_path_factory):
    return chat_moe(tiny_models("llama"), tmp_path_factory.mktemp("ask"))


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

    base = add_chat_template(shutil.copytree(tiny_models("llama")["base"], tmp_path / "base"))
    (a,) = ask(base, {"q": "hello"}, max_new_tokens=4)
    assert a.shares == {} and len(a.ids) <= 4


def test_a_qwen2_moe_answers_with_its_expert_names(tiny_models, tmp_path):
    """Qwen MoE configs count experts as ``num_experts`` (Mixtral: ``num_local_experts``)."""
    out = chat_moe(tiny_models("qwen2"), tmp_path, ("code", "legal"))
    (a,) = ask(out, {"q": "def main():"}, max_new_tokens=4)
    assert set(a.shares) == {"code", "legal"} and sum(a.shares.values()) == pytest.approx(1.0, abs=1e-3)
