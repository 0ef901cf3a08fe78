"""The ``.litertlm`` bundle of a TFLite export, this side: what its metadata says (start and stop tokens, read from
the model's tokenizer and generation config as transformers applies them), why a chunked model gets none, and the
check that it generates in LiteRT-LM what transformers does (:mod:`moetool.export.tflite.lm_worker` runs the
engine in litert-torch's interpreter; the bundle itself is written by the conversion's worker,
:mod:`moetool.export.tflite.worker`, around the model it has just quantized).
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetool.export.base import ExportError
from moetool.export.greedy import common_prefix, greedy_reference, stop_ids

if TYPE_CHECKING:
    from torch import nn

__all__ = ["BUNDLE", "NO_BUNDLE", "PROMPT", "RUNNER", "bundle_tokens", "litert_lm_missing", "runner_check"]

BUNDLE = "model.litertlm"
RUNNER = "LiteRT-LM (litert-lm-api 0.18.1)"
# LiteRT-LM 0.18 runs one decoder model: a bundle with two PREFILL_DECODE sections silently uses one, and the only
# split it reads is an embedder beside the decoder
NO_BUNDLE = (
    "not written: the model converts as {n} chunks, and LiteRT-LM runs one decoder model (a bundle of several "
    "decoder sections uses one); export it as one chunk (--chunk-layers at least the layer count) for a bundle"
)
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
NEW_TOKENS = 16


@functools.cache
def litert_lm_missing() -> tuple[str, ...]:
    """The LiteRT-LM packages (the bundle's builder, its runtime) that litert-torch's interpreter lacks: a venv made
    before they joined the ``tflite`` extra converts but cannot bundle. Looked up without importing anything."""
    from moetool.export.tflite.runner import litert_python

    probe = "import importlib.util as u; print(','.join(m for m in ('litert_lm_builder', 'litert_lm') "
    probe += "if not u.find_spec(m)))"
    out = subprocess.run([litert_python(), "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    names = {"litert_lm_builder": "litert-lm-builder", "litert_lm": "litert-lm-api"}
    return tuple(names[m] for m in out.split(",") if m)


def bundle_tokens(model_dir: Path) -> tuple[list[int], list[int]]:
    """(start ids, stop ids) of the bundle's metadata. Start: what the model's tokenizer puts before a text in
    transformers (SmolLM2's adds nothing; LiteRT-LM's tokenizer never adds it, the runtime prepends these to the
    first prefill). Stop: the eos ids of ``generation_config.json`` and of the tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    plain = list(tok(PROMPT, add_special_tokens=False)["input_ids"])
    full = list(tok(PROMPT)["input_ids"])
    start = full[: full.index(plain[0])] if plain and plain[0] in full else []
    stop = stop_ids(model_dir)
    return start, stop


def runner_check(bundle: Path, model_dir: Path, reference: nn.Module, capacity: int, *, judge: bool) -> dict[str, Any]:
    """The ``runner`` record: ``bundle`` loaded in LiteRT-LM, :data:`PROMPT` prefilled and :data:`NEW_TOKENS`
    decoded greedily, against ``reference`` (transformers) decoding the same prompt greedily.

    Raises:
        ExportError: ``judge`` (a float plan) and the texts differ.
    """
    from transformers import AutoTokenizer

    from moetool.export.tflite.runner import run_worker

    request = {"bundle": str(bundle), "prompt": PROMPT, "max_new": NEW_TOKENS, "capacity": capacity}
    got = run_worker("moetool.export.tflite.lm_worker", request, what="the LiteRT-LM check")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = list(tok(PROMPT)["input_ids"])
    new = greedy_reference(reference, prompt, NEW_TOKENS, stop_ids(model_dir), keep_stop=False)
    ref_text = tok.decode(new)
    text = str(got["text"])
    # a random tiny model's tokens may end inside a UTF-8 character: both tokenizers decode such bytes to U+FFFD, so
    # the texts still compare; and the tokens are counted after re-tokenising both texts with transformers'
    # tokenizer (not against the ids decoded: one text has several tokenisations, greedy need not pick BPE's)
    ours, theirs = (list(tok(t, add_special_tokens=False)["input_ids"]) for t in (text, ref_text))
    record: dict[str, Any] = {
        "name": RUNNER,
        "file": bundle.name,
        "prompt": PROMPT,
        "text": text,
        "reference_text": ref_text,
        "same_text": text == ref_text,
        "same_prefix_tokens": common_prefix(ours, theirs),
        "reference_tokens": len(theirs),
        "reference_prompt_tokens": len(prompt),
    } | {k: got[k] for k in ("prompt_tokens", "new_tokens", "prefill_tok_s", "decode_tok_s", "ttft_s")}
    record["judged"] = judge
    if judge and not record["same_text"]:
        raise ExportError(
            f"{bundle.name} in {RUNNER} generated {text!r} where transformers generates {ref_text!r} (float plan: "
            "they must agree)"
        )
    return record
