"""lm-evaluation-harness: moetool's local continuation tasks run in lm-eval and score what a direct computation gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lm_fixtures import tiny_llama

from moetool.errors import MoetoolError
from moetool.eval.harness import TaskError, task_scores
from moetool.eval.tasks import CHOICE_WORDS, CONTEXT_WORDS, N_CHOICES, continuation_items, write_local_tasks
from moetool.zoo.tokenizer import train_tokenizer

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")

# passages of four kinds of text, one kind per passage (as many words as a passage holds): a context's own kind
# predicts its continuation, so a model that learnt the text beats the distractors of other kinds
KINDS = [
    s.split()
    for s in (
        "the quick brown fox jumps over the lazy dog while a cat sleeps",
        "def add ( a , b ) : return a + b if a else b",
        "the licensee shall keep all notices and the licensor grants rights",
        "acute bronchitis with fever and cough treated with rest and fluids",
    )
]
_SPAN = CONTEXT_WORDS + CHOICE_WORDS
TEXT = " ".join(" ".join((KINDS[i % 4] * 8)[(i * 7) % 11 :][:_SPAN]) for i in range(24))


def test_items_hold_the_true_continuation_at_gold():
    items = continuation_items(TEXT, seed=3)
    assert items == continuation_items(TEXT, seed=3) and items != continuation_items(TEXT, seed=4)
    words = TEXT.split()
    for it in items[:20]:
        assert len(it.choices) == N_CHOICES and len(set(it.choices)) == N_CHOICES
        ctx = it.context.split()
        start = next(i for i in range(0, len(words), CONTEXT_WORDS + CHOICE_WORDS) if words[i : i + len(ctx)] == ctx)
        true = " " + " ".join(words[start + CONTEXT_WORDS : start + CONTEXT_WORDS + CHOICE_WORDS])
        assert it.choices[it.gold] == true
    assert {it.gold for it in items} == set(range(N_CHOICES))


def test_cached_items_follow_the_settings(tmp_path, monkeypatch):
    from moetool.eval import tasks

    (cfg,) = write_local_tasks({"legal": TEXT}, tmp_path).values()
    monkeypatch.setattr(tasks, "CONTEXT_WORDS", CONTEXT_WORDS + 2)
    (other,) = write_local_tasks({"legal": TEXT}, tmp_path).values()
    first, second = (Path(c["dataset_kwargs"]["data_files"]["test"]) for c in (cfg, other))
    assert first != second and first.is_file() and second.is_file()
    assert len(json.loads(second.read_text().splitlines()[0])["context"].split()) == CONTEXT_WORDS + 2


def test_short_text_is_refused():
    with pytest.raises(MoetoolError, match="too short for a continuation task"):
        continuation_items("a few words only")


@pytest.fixture(scope="module")
def lm():
    tok = train_tokenizer([TEXT], vocab_size=400)
    model = tiny_llama(tok).train()
    # a few steps on the text, so the scores are not chance and a wrong pairing of choices and gold would show
    # the whole text, memorised: its own continuations then score far above chance
    flat = tok(TEXT)["input_ids"]
    ids = torch.tensor(flat[: len(flat) // 64 * 64]).view(-1, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), tok


def _direct(model, tok, item) -> tuple[int, int]:
    """(argmax of summed log-likelihood, argmax of it per character of the choice), tokenised as lm-eval does:
    context alone, then context + choice, the choice's tokens being what follows the context's."""
    lls = []
    ctx = tok(item["context"])["input_ids"]
    for choice in item["choices"]:
        whole = tok(item["context"] + choice)["input_ids"]
        cont = whole[len(ctx) :]
        inp = torch.tensor([whole[:-1]])
        with torch.no_grad():
            logp = model(input_ids=inp).logits[0].log_softmax(-1)
        lls.append(sum(float(logp[len(whole) - len(cont) - 1 + k, t]) for k, t in enumerate(cont)))
    norm = [ll / len(c) for ll, c in zip(lls, item["choices"], strict=True)]
    return max(range(len(lls)), key=lls.__getitem__), max(range(len(norm)), key=norm.__getitem__)


def test_local_task_scores_equal_a_direct_computation(tmp_path, lm):
    model, tok = lm
    configs = write_local_tasks({"legal": TEXT}, tmp_path)
    ((name, cfg),) = configs.items()
    limit = 16
    scores = task_scores(model, tok, [cfg], limit=limit)[name]
    path = cfg["dataset_kwargs"]["data_files"]["test"]
    items = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()][:limit]
    preds = [_direct(model, tok, it) for it in items]
    acc = sum(p == it["gold"] for (p, _), it in zip(preds, items, strict=True)) / limit
    acc_norm = sum(p == it["gold"] for (_, p), it in zip(preds, items, strict=True)) / limit
    assert scores["n"] == limit
    assert scores["acc"] == pytest.approx(acc, abs=1e-9) and scores["acc_norm"] == pytest.approx(acc_norm, abs=1e-9)
    assert scores["acc"] > 1 / N_CHOICES, "a model trained on the text should beat chance on its continuations"
    assert scores["acc_stderr"] > 0


def test_unknown_task_names_itself(lm):
    model, tok = lm
    with pytest.raises(TaskError, match="no_such_task"):
        task_scores(model, tok, ["no_such_task"], limit=2)


def _saved(tmp_path, lm, monkeypatch, *names: str) -> None:
    """The trained model saved as ``tmp_path/NAME`` for each name, ``legal.txt`` beside them, a private cache."""
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    model, tok = lm
    for name in names:
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    (tmp_path / "legal.txt").write_text(TEXT)


def test_evaluate_reports_tasks_beside_perplexity(tmp_path, lm, monkeypatch):
    from moetool.api import evaluate, write_report
    from moetool.cli.render import print_report

    _saved(tmp_path, lm, monkeypatch, "m")
    m = str(tmp_path / "m")
    report = evaluate(
        [m], domains=["legal"], data={"legal": tmp_path / "legal.txt"}, max_tokens=512, tasks=["local"], limit=8
    )
    assert set(report["tasks"][m]) == {"moetool_cont_legal"} and report["tasks"][m]["moetool_cont_legal"]["n"] == 8
    assert report["settings"]["tasks"] == {"names": ["moetool_cont_legal"], "limit": 8, "num_fewshot": None}
    assert list((tmp_path / "cache" / "lm-eval-tasks").glob("moetool_cont_legal-*.jsonl"))
    written = write_report(report, tmp_path / "eval.json", tmp_path / "plots")
    assert tmp_path / "plots" / "tasks.png" in written
    print_report(report)  # the task table renders beside the perplexity table


def test_task_files_removed_between_models_are_rebuilt(tmp_path, lm, monkeypatch):
    """The demo lost 65 minutes to another process clearing the task cache before its fourth model: a cache entry
    that vanished is written again at use, and every model is scored."""
    import shutil

    from moetool.api import evaluate

    _saved(tmp_path, lm, monkeypatch, "a", "b")
    seen = []

    def clear_cache(m: str) -> None:
        seen.append(m)
        shutil.rmtree(tmp_path / "cache" / "lm-eval-tasks", ignore_errors=True)

    models = [str(tmp_path / "a"), str(tmp_path / "b")]
    data = {"legal": tmp_path / "legal.txt"}
    report = evaluate(models, data=data, max_tokens=512, tasks=["local"], limit=4, on_model=clear_cache)
    assert seen == models
    assert all(report["tasks"][m]["moetool_cont_legal"]["n"] == 4 for m in models)


def test_optional_tasks_fail_per_model_and_the_evaluation_goes_on(tmp_path, lm, monkeypatch):
    from moetool.api import evaluate
    from moetool.eval import harness

    _saved(tmp_path, lm, monkeypatch, "m")

    def broken(*args, **kwargs):
        raise TaskError("lm-eval could not run moetool_cont_legal: no such file")

    monkeypatch.setattr(harness, "task_scores", broken)
    m, data = str(tmp_path / "m"), {"legal": tmp_path / "legal.txt"}
    with pytest.raises(TaskError):
        evaluate([m], data=data, max_tokens=512, tasks=["local"], limit=4)
    report = evaluate([m], data=data, max_tokens=512, tasks=["local"], limit=4, optional_tasks=True)
    assert report["task_failures"] == {m: "lm-eval could not run moetool_cont_legal: no such file"}
    assert report["perplexity"][m]["legal"] > 0 and report["tasks"] == {}
