"""Held-out perplexity: agrees with the model's own loss, and is the vocab size for a uniform model."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from lm_fixtures import tiny_llama
from transformers import AutoTokenizer

from moetool.eval.perplexity import perplexity, perplexity_matrix, render_matrix, token_nll
from moetool.zoo.tokenizer import train_tokenizer

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    "def add(a, b):\n    return a + b\n"
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software.\n"
) * 4


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([TEXT, TEXT.upper()], vocab_size=400)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer)


def _labels_loss(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    with torch.no_grad():
        return float(model(input_ids=x, labels=x).loss)


def test_one_window_matches_labels_loss(model, tokenizer):
    text = TEXT[:300]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 10 < len(ids) < 255
    window = [tokenizer.bos_token_id, *ids]  # BOS context, every text token scored
    expected = math.exp(_labels_loss(model, window))
    got = perplexity(model, tokenizer, text, seq_len=256)
    assert got == pytest.approx(expected, rel=1e-5)
    # a random model is close to uniform, not better than chance by much
    assert 0.5 * len(tokenizer) < got < 2 * len(tokenizer)


def test_windows_and_max_tokens(model, tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    seq_len, bos = 16, tokenizer.bos_token_id
    total, count = 0.0, 0
    for start in range(0, len(ids), seq_len - 1):
        window = [bos, *ids[start : start + seq_len - 1]]
        total += _labels_loss(model, window) * (len(window) - 1)
        count += len(window) - 1
    nll, n = token_nll(model, tokenizer, TEXT, seq_len=seq_len, batch_size=3)
    assert n == count == len(ids)
    assert nll == pytest.approx(total, rel=1e-5)
    assert perplexity(model, tokenizer, TEXT, seq_len=seq_len) == pytest.approx(math.exp(total / count), rel=1e-5)

    # max_tokens scores only the first tokens
    first = [bos, *ids[:10]]
    assert perplexity(model, tokenizer, TEXT, seq_len=64, max_tokens=10) == pytest.approx(
        math.exp(_labels_loss(model, first)), rel=1e-5
    )


class _Uniform(torch.nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        b, t = input_ids.shape
        return SimpleNamespace(logits=torch.zeros(b, t, self.vocab))


def test_uniform_logits_give_vocab_size(tokenizer):
    vocab = len(tokenizer)
    assert perplexity(_Uniform(vocab), tokenizer, TEXT, seq_len=32) == pytest.approx(vocab, rel=1e-5)


class _CharTokenizer:
    """No BOS token: the first token of each window is context only."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": [ord(c) % 50 for c in text]}


def test_no_bos_windows():
    text = "abcdefghij" * 5  # 50 tokens -> windows of 16, 16, 16, 2 -> 15 + 15 + 15 + 1 scored
    nll, n = token_nll(_Uniform(50), _CharTokenizer(), text, seq_len=16)
    assert n == 46
    assert math.exp(nll / n) == pytest.approx(50, rel=1e-5)


def test_matrix_from_paths_and_render(tmp_path, model, tokenizer):
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    assert AutoTokenizer.from_pretrained(tmp_path / "m")("x")["input_ids"][0] == tokenizer.bos_token_id
    texts = {"a": TEXT, "b": TEXT.upper()}
    matrix = perplexity_matrix(
        {"path": tmp_path / "m", "obj": (model, tokenizer), "uniform": (_Uniform(len(tokenizer)), tokenizer)},
        texts,
        seq_len=64,
    )
    assert set(matrix) == {"path", "obj", "uniform"}
    for t in texts:
        assert matrix["path"][t] == pytest.approx(matrix["obj"][t], rel=1e-5)
        assert matrix["uniform"][t] == pytest.approx(len(tokenizer), rel=1e-5)
    table = render_matrix(matrix, "ppl")
    assert [c.header for c in table.columns] == ["model", "a", "b"]
    assert table.row_count == 3


def test_eval_reads_every_data_file_and_refuses_one_it_would_ignore(model, tokenizer, tmp_path, monkeypatch):
    """``moetool eval --data NAME=FILE`` evaluates NAME on FILE without --domains (it used to evaluate the zoo's
    code, legal and medical instead), and refuses a --domains list that would leave the file unread."""
    from typer.testing import CliRunner

    from moetool.cli import app

    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "notes.txt").write_text(TEXT, encoding="utf-8")
    runner = CliRunner()
    args = ["eval", str(tmp_path / "m"), "--data", f"notes={tmp_path / 'notes.txt'}", "--seq-len", "32"]
    res = runner.invoke(app, [*args, "-o", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    assert list(report["perplexity"][str(tmp_path / "m")]) == ["notes"]
    res = runner.invoke(app, [*args, "--domains", "code"])
    assert res.exit_code != 0 and "notes is not among --domains code" in res.output


def test_eval_refuses_bad_input_before_any_work(model, tokenizer, tmp_path, monkeypatch):
    """Named errors, not tracebacks, and the user's held-out file never overwritten by --json."""
    from typer.testing import CliRunner

    from moetool.cli import app

    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    held = tmp_path / "notes.txt"
    held.write_text(TEXT, encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    runner = CliRunner()
    m = str(tmp_path / "m")

    def run(*args: str) -> tuple[int, str]:
        res = runner.invoke(app, ["eval", m, *args])
        return res.exit_code, " ".join(re.sub("[│╭╮╰╯─]", " ", res.output).split())

    code, text = run("--data", f"notes={held}", "-o", str(held))
    assert code != 0 and "is an input" in text
    assert held.read_text(encoding="utf-8") == TEXT
    code, text = run("--data", f"notes={held}", "-o", str(tmp_path))
    assert code != 0 and "is a directory" in text
    code, text = run("--data", str(held))
    assert code == 2 and "is not DOMAIN=FILE" in text
    code, text = run("--data", f"notes={held}", "--seq-len", "0")
    assert code == 2 and "seq-len" in text
    code, text = run("--data", f"x={tmp_path / 'latin1.txt'}")
    assert code != 0 and "not UTF-8 text (byte 3" in text
    code, text = run("--data", f"x={tmp_path}")
    assert code != 0 and "is a directory, not a file" in text


@pytest.mark.parametrize("where", ["mlp", "unused-embedding"])
def test_eval_of_a_model_with_nan_weights_fails_naming_it(model, tokenizer, tmp_path, monkeypatch, where):
    """NaN in a weight: refused naming the weight, exit 2, no report written. An embedding row of a token the text
    never holds leaves every perplexity finite, which is why the weights are checked, not only the figures."""
    import copy

    from typer.testing import CliRunner

    from moetool.cli import app

    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "cache"))
    broken = copy.deepcopy(model)
    with torch.no_grad():
        if where == "mlp":
            broken.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
        else:
            seen = set(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
            unused = max(set(range(broken.config.vocab_size)) - seen - {tokenizer.bos_token_id})
            broken.model.embed_tokens.weight[unused] = float("nan")
    broken.save_pretrained(tmp_path / "nan")
    tokenizer.save_pretrained(tmp_path / "nan")
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    report = tmp_path / "report.json"
    res = CliRunner().invoke(
        app,
        ["eval", str(tmp_path / "nan"), "--data", f"t={tmp_path / 't.txt'}", "--seq-len", "32", "-o", str(report)],
    )
    text = " ".join(res.output.split())
    weight = "model.layers.0.mlp.down_proj.weight" if where == "mlp" else "model.embed_tokens.weight"
    assert res.exit_code == 2 and f"weight {weight} holds NaN or Inf values" in text, res.output
    assert not report.exists()


def test_non_finite_logits_are_refused_by_name(tokenizer):
    """Finite weights can still overflow: a NaN or Inf logit ends the scoring with a named error, not a NaN figure."""
    from moetool.eval.perplexity import NonFiniteModel

    def overflowing(input_ids):
        logits = torch.zeros(*input_ids.shape, 400)
        logits[..., 7] = float("inf")
        return SimpleNamespace(logits=logits)

    with pytest.raises(NonFiniteModel, match="non-finite logits"):
        token_nll(overflowing, tokenizer, TEXT, seq_len=32)
