"""Running the ONNX decoder: prefill and decode calls over one onnxruntime session (for the parity check), and greedy
generation in onnxruntime-genai from the written folder, compared with transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moetool.export.graph.parity import Decode, Prefill
from moetool.export.heldout import reference_logits
from moetool.export.onnx.decoder import past_names
from moetool.io.jsontypes import JsonObject

if TYPE_CHECKING:
    from onnxruntime import InferenceSession


def ort_session(path: Path) -> InferenceSession:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_runners(session: InferenceSession, n_layers: int, kv_heads: int, head_dim: int) -> tuple[Prefill, Decode]:
    """Prefill (an empty past) and one-token decode calls into ``session``, batch 1, no padding."""
    names = past_names(n_layers)

    def run(ids: np.ndarray, start: int, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        t = ids.shape[1]
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((1, start + t), dtype=np.int64),
            "position_ids": np.arange(start, start + t, dtype=np.int64)[None],
        }
        feeds |= dict(zip(names, past, strict=True))
        out = session.run(None, feeds)
        return out[0], out[1:]

    def prefill(ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        empty = np.zeros((1, kv_heads, 0, head_dim), dtype=np.float32)
        return run(ids, 0, [empty] * len(names))

    def decode(ids: np.ndarray, pos: int, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        return run(ids, pos, past)

    return prefill, decode


def genai_check(out_dir: Path, hf: Any, prompt: list[int], new_tokens: int = 16) -> JsonObject | None:
    """Greedy tokens from onnxruntime-genai driving ``out_dir`` against transformers' greedy choices on the same
    prompt ids; None when onnxruntime-genai is not installed (the ``onnx`` extra installs it).

    transformers is teacher-forced over the prompt and onnxruntime-genai's tokens in one pass (one read of a model
    streamed from disk): its greedy generation equals them exactly when each of its argmaxes is the next token, so
    the first position where one is not is where the two generations part."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    model = og.Model(str(out_dir))
    params = og.GeneratorParams(model)
    total = len(prompt) + new_tokens
    params.set_search_options(max_length=total, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    got = [int(t) for t in gen.get_sequence(0)][len(prompt) :]
    del gen, params, model  # its copy of the weights, before transformers runs
    logits = reference_logits(hf, [prompt + got])[0]  # [len(prompt) + len(got), V]
    want = logits[len(prompt) - 1 :].argmax(-1).tolist()  # the greedy choice after each prefix
    first = next((i for i, t in enumerate(got) if want[i] != t), None)
    eos = hf.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if first is None and len(got) < new_tokens and (not got or got[-1] not in stops):
        first = len(got)  # onnxruntime-genai stopped where transformers would have gone on
    return {
        "runner": f"onnxruntime-genai {og.__version__}",
        "prompt_tokens": len(prompt),
        "new_tokens": len(got),
        "tokens_equal": first is None,
        "first_difference": first,
    }
