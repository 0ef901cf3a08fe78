"""The program generating in ExecuTorch's own LLM runner (``TextLLMRunner``, the C++ runner of its demo apps, through
the ``executorch`` wheel's bindings), compared with transformers' greedy continuation of the same prompt.

The runner runs in a process of its own (:func:`runner_generate`):

    python -m moetool.export.executorch.runner_check REQUEST.json

REQUEST has ``pte``, ``ptd``, ``tokenizer`` (the folder with ``tokenizer.json``), ``prompt`` (text) and
``new_tokens``. The result: ``raw`` (the bytes it printed, carried as latin-1 text) and its own ``stats`` (prompt
and generated tokens, prefill and decode tokens per second, the times of load, first token and end).

Why its own process, and why the text is read from its standard output: the runner prints every piece it generates
to the C library's stdout (which would land in the middle of moetool's output), and the bindings hand a Python
callback each piece as ``str``, which fails on a piece that ends inside a multi-byte UTF-8 character (byte-level
BPE splits them) and aborts the generation. So no callback is given; the worker points file descriptor 1 at a file
while the runner generates and reads the bytes back.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

from moetool.export.jsonnum import integer, number

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from moetool.io.jsontypes import JsonObject, JsonValue

__all__ = ["printed_piece", "runner_check", "runner_generate", "runner_prompt"]

_STATS = "ExecuTorch runner's stats"


class _Stats(Protocol):
    """The runner's figures as its stats callback gets them."""

    def to_json_string(self) -> str: ...


class RunnerOutput(TypedDict):
    """What the runner printed (its stats line cut off) and its own figures."""

    text: bytes
    stats: JsonObject


def _generate(request: Mapping[str, JsonValue]) -> JsonObject:
    """The worker: one greedy generation in TextLLMRunner, its stdout captured (the module docstring says why)."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    runner = TextLLMRunner(request["pte"], request["tokenizer"], request["ptd"])
    stats: JsonObject = {}

    def on_stats(s: _Stats) -> None:
        stats.update(json.loads(s.to_json_string()))

    # temperature 0 is greedy (the bindings' default is 0.8); nothing added around the prompt: it is given whole
    cfg = GenerationConfig(
        echo=False,
        max_new_tokens=integer(request["new_tokens"], "new_tokens", "the runner check's request"),
        temperature=0.0,
    )
    cfg.num_bos, cfg.num_eos = 0, 0
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile() as captured:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(captured.fileno(), 1)
        try:
            runner.generate(request["prompt"], cfg, None, on_stats)
        finally:
            libc.fflush(None)  # what the C library still buffers belongs to the capture, not to moetool's output
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        raw = captured.read()
    return {"raw": raw.decode("latin-1"), "stats": stats}


def runner_generate(pte: Path, ptd: Path, tokenizer: Path, prompt: str, new_tokens: int) -> RunnerOutput:
    """``new_tokens`` greedy tokens after ``prompt`` from TextLLMRunner over the program ``pte`` and its weights
    ``ptd``: ``{"text": the bytes it printed, "stats": its own figures}``."""
    from moetool.export.worker import run_worker

    request = {"pte": str(pte), "ptd": str(ptd), "tokenizer": str(tokenizer), "prompt": prompt}
    result = run_worker(
        "moetool.export.executorch.runner_check", request | {"new_tokens": new_tokens}, what="ExecuTorch's runner"
    )
    raw = str(result["raw"]).encode("latin-1")
    # after the pieces the runner prints a newline and its stats line ("PyTorchObserver {...}")
    raw = raw.split(b"\nPyTorchObserver ", 1)[0]
    return {"text": raw, "stats": result["stats"]}


# what the runner prints of a one-byte piece: a printable character or white space only (its ``safe_printf``: a lone
# byte of a multi-byte character, or a control code, is left out)
_PRINTED_BYTES = frozenset(range(0x20, 0x7F)) | frozenset(b" \t\n\v\f\r")


def printed_piece(tok: PreTrainedTokenizerBase, token: int) -> bytes:
    """The bytes the runner prints for ``token``: its piece as the tokenizer decodes it alone (byte-level BPE: the
    token's bytes, through GPT-2's byte-to-character table), a lone unprintable byte dropped as the runner drops it."""
    backend = getattr(tok, "backend_tokenizer", None)
    piece: bytes
    if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
        chars = _byte_chars()
        name = tok.convert_ids_to_tokens(token)
        assert isinstance(name, str)  # one id, one token
        piece = bytes(chars[c] for c in name) if all(c in chars for c in name) else name.encode()
    else:
        decoded = tok.decode([token])
        assert isinstance(decoded, str)  # one sequence of ids, one text
        piece = decoded.encode()
    return b"" if len(piece) == 1 and piece[0] not in _PRINTED_BYTES else piece


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE vocabulary → the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def runner_prompt(tok: PreTrainedTokenizerBase) -> str:
    """The check's prompt: a question through the model's chat template where it has one (what an app sends)."""
    question = "What is the capital of France?"
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)  # tokenize=False: the text
        return text
    return "The capital of France is"


def runner_check(
    pte: Path, ptd: Path, tokenizer_dir: Path, hf: nn.Module, stops: set[int], *, new_tokens: int = 16
) -> JsonObject:
    """The program's greedy generation in TextLLMRunner against transformers' (:func:`greedy_reference`) on the
    check's prompt (:func:`runner_prompt`): the two texts, whether they are the same, how many of transformers'
    tokens the runner's text begins with, and the runner's speed as it measured it."""
    from transformers import AutoTokenizer

    from moetool.export.greedy import greedy_reference

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    prompt = runner_prompt(tok)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    got = runner_generate(pte, ptd, tokenizer_dir, prompt, new_tokens)
    want = greedy_reference(hf, ids, new_tokens, stops, vocab=len(tok))
    text = got["text"]
    # the runner prints each piece as it comes: its bytes begin with transformers' first k tokens' pieces (as the
    # runner would print them, :func:`printed_piece`) for the first k tokens to be the same
    pieces = [printed_piece(tok, t) for t in want]
    same = 0
    while same < len(pieces) and text.startswith(b"".join(pieces[: same + 1])):
        same += 1
    stats = got["stats"]
    return {
        "runner": "ExecuTorch TextLLMRunner (executorch.extension.llm.runner)",
        "prompt": prompt,
        "prompt_tokens": integer(stats.get("prompt_tokens", 0), "prompt_tokens", _STATS),
        "reference_prompt_tokens": len(ids),
        "new_tokens": len(want),
        "text": text.decode("utf-8", errors="replace"),
        "reference_text": b"".join(pieces).decode("utf-8", errors="replace"),
        "tokens_equal": same == len(want),
        "same_leading_tokens": same,
        # the runner times in whole milliseconds and leaves a rate out when its span rounds to 0 ms (a tiny model's
        # prefill on a fast machine): the rate is then None, the span 0
        "prefill_ms": _span(stats, "inference_start_ms", "prompt_eval_end_ms"),
        "decode_ms": _span(stats, "prompt_eval_end_ms", "inference_end_ms"),
        "prefill_tok_s": _rate(stats, "prefill_token_per_sec"),
        "decode_tok_s": _rate(stats, "decode_token_per_sec"),
        "time_to_first_token_ms": _ttft(stats),
        "load_ms": _span(stats, "model_load_start_ms", "model_load_end_ms"),
    }


def _span(stats: Mapping[str, JsonValue], start: str, end: str) -> float | None:
    if start in stats and end in stats:
        return number(stats[end], end, _STATS) - number(stats[start], start, _STATS)
    return None


def _rate(stats: Mapping[str, JsonValue], key: str) -> float | None:
    return number(stats[key], key, _STATS) if key in stats else None


def _ttft(stats: Mapping[str, JsonValue]) -> float | None:
    return _span(stats, "inference_start_ms", "first_token_ms")


if __name__ == "__main__":
    from moetool.export.worker import worker_main

    worker_main(_generate)
