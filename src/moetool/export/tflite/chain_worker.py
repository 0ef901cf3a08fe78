"""The parity calls through a TFLite model of one or several chunks, in the LiteRT interpreter, one chunk loaded at a
time (:func:`moetool.export.graph.chunk.chain_calls`); run where ``ai_edge_litert`` is installed:

    python -m moetool.export.tflite.chain_worker REQUEST.json

REQUEST has paths (the chunks' ``.tflite`` files, in order), capacity and prefill_len (as converted), calls (an
``.npz`` of the calls' token ids ``[1, T]``, in order), positions (per call: null for a prefill, else the decoded
token's position) and out (the ``.npz`` to write: each call's logits ``[1, T, V]``, in order). Prints the number of
calls run.

A model of every layer in one is in LiteRT-LM's layout (:func:`litertlm_runner`: its signatures and inputs by
name), a chunk of a larger one in moetool's (``prefill``/``decode``, inputs ``args_N``). Each chunk's static-shape
signatures are fed as converted: a prefill right-padded to prefill_len (causal attention
leaves the real positions exact; the padded cache slots are overwritten by later decode steps and hidden by the mask
until then), a decode one token at a time, and the mask built for the cache's capacity.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from moetool.export.graph.chunk import ChunkRunner


def chunk_runner(path: Path, capacity: int, prefill_len: int) -> ChunkRunner:
    """The ``prefill`` and ``decode`` signatures of the chunk at ``path`` as one runner of the chain: no past is a
    prefill from an empty cache."""
    from ai_edge_litert.interpreter import Interpreter

    from moetool.export.graph.static import static_mask
    from moetool.export.tflite.runner import signature_outputs

    it = Interpreter(model_path=str(path))
    if "prefill" not in it.get_signature_list():
        return litertlm_runner(it, capacity, prefill_len)
    pre, dec = it.get_signature_runner("prefill"), it.get_signature_runner("decode")
    n_cache = len(it.get_signature_list()["prefill"]["inputs"]) - 3
    kv_shape = pre.get_input_details()["args_3"]["shape"] if n_cache else ()

    def run(
        x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, past: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        t = x.shape[1]
        if past is None:  # right-padded to the converted prefill length, from an empty cache
            padded = torch.zeros((1, prefill_len, *x.shape[2:]), dtype=x.dtype)
            padded[:, :t] = x
            x, pos = padded, torch.arange(prefill_len)[None]
            caches = [np.zeros(tuple(kv_shape), dtype=np.float32) for _ in range(n_cache)]
        else:
            caches = [c.numpy() for c in past]
        ids = x.numpy().astype(np.int32) if x.dtype == torch.long else x.numpy().astype(np.float32)
        feeds = {"args_0": ids, "args_1": pos.numpy().astype(np.int32), "args_2": static_mask(pos, capacity).numpy()}
        feeds |= {f"args_{3 + i}": c for i, c in enumerate(caches)}
        out = signature_outputs(pre if past is None else dec, feeds)
        return torch.from_numpy(out[0][:, :t].copy()), [torch.from_numpy(c) for c in out[1 : 1 + n_cache]]

    return run


def litertlm_runner(it: Any, capacity: int, prefill_len: int) -> ChunkRunner:
    """A whole model in LiteRT-LM's layout (:mod:`moetool.export.tflite.litertlm`) loaded in interpreter ``it``, fed
    by name: ``prefill_<prefill_len>`` right-padded from an empty cache, ``decode`` one token at a time."""
    from moetool.export.graph.static import static_mask
    from moetool.export.tflite.litertlm import cache_names

    pre, dec = it.get_signature_runner(f"prefill_{prefill_len}"), it.get_signature_runner("decode")
    names = cache_names((len(pre.get_input_details()) - 3) // 2)  # beside tokens, input_pos and mask
    kv_shape = tuple(pre.get_input_details()[names[0]]["shape"])

    def run(
        x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, past: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        t = x.shape[1]
        if past is None:
            ids = np.zeros((1, prefill_len), dtype=np.int32)
            ids[0, :t] = x.numpy()
            pos = torch.arange(prefill_len)[None]
            caches = [np.zeros(kv_shape, dtype=np.float32) for _ in names]
        else:
            ids, caches = x.numpy().astype(np.int32), [c.numpy() for c in past]
        feeds = {"tokens": ids, "input_pos": pos[0].numpy().astype(np.int32)}
        feeds |= {"mask": static_mask(pos, capacity).numpy()} | dict(zip(names, caches, strict=True))
        out = (pre if past is None else dec)(**feeds)
        return torch.from_numpy(out["logits"][:, :t].copy()), [torch.from_numpy(out[n]) for n in names]

    return run


def run_chain(req: dict[str, Any]) -> dict[str, Any]:
    """The request (module docstring) in, the logits written, the count out."""
    from moetool.export.graph.chunk import chain_calls

    cap, plen = int(req["capacity"]), int(req["prefill_len"])
    with np.load(req["calls"]) as saved:
        calls = [(saved[f"arr_{j}"], pos) for j, pos in enumerate(req["positions"])]

    def opener(path: str) -> Any:
        return lambda: chunk_runner(Path(path), cap, plen)

    logits = chain_calls(calls, (opener(p) for p in req["paths"]))
    np.savez(req["out"], *logits)
    return {"calls": len(logits)}


if __name__ == "__main__":
    from moetool.export.worker import worker_main

    worker_main(run_chain)
