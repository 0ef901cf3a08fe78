"""``api.ask``: a GGUF in llama.cpp answers the same chat-templated ids as the model in transformers; an f32 GGUF of
a tiny MoE gives exactly transformers' greedy answer."""

from __future__ import annotations

import llama_cpp  # noqa: F401  (the dev extra installs it; a missing runtime must fail, not skip)
import pytest
from chat_fixtures import chat_moe

from moetool.api import ask, export
from moetool.export.gguf.generate import GgufGenerator


@pytest.fixture(scope="module")
def moe_and_gguf(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("askg")
    out = chat_moe(tiny_models("llama"), tmp, ("code", "legal"))
    manifest = export(out, tmp / "gguf", quant="f32")
    return out, tmp / "gguf" / manifest["file"]


def test_f32_gguf_answers_like_transformers(moe_and_gguf):
    moe, gguf_file = moe_and_gguf
    questions = {"code": "def main():", "legal": "Permission is hereby granted, free of charge"}
    answers = ask(moe, questions, ggufs={"f32": gguf_file}, max_new_tokens=10)
    assert [q.answer.label for q in answers] == ["code", "legal"]
    for q in answers:
        g = q.gguf["f32"]
        assert g.ids == q.answer.ids and g.matches and g.same_prefix == len(g.ids)
        assert g.text == q.answer.text
        doc = q.to_json()
        assert doc["gguf"]["f32"]["matches_transformers"] is True and doc["expert_shares"] == q.answer.shares


def test_generator_stops_at_a_stop_token_and_at_the_context(moe_and_gguf):
    moe, gguf_file = moe_and_gguf
    (q,) = ask(moe, {"x": "def main():"}, max_new_tokens=6)
    gen = GgufGenerator(gguf_file, n_ctx=len(q.answer.prompt_ids) + 3)
    try:
        ids, _ = gen.greedy(q.answer.prompt_ids, 6, stop=[])
        assert len(ids) == 3  # the context holds three more tokens
        if q.answer.ids:
            first = q.answer.ids[0]
            ids, _ = gen.greedy(q.answer.prompt_ids, 6, stop=[first])
            assert ids == []
    finally:
        gen.close()


def test_no_questions_no_work(moe_and_gguf):
    assert ask(moe_and_gguf[0], {}) == []
