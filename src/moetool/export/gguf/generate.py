"""Greedy generation from a GGUF in llama.cpp (through llama-cpp-python), on token ids a Hugging Face tokenizer made."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moetool.export.gguf.verify import load_llama, quiet_stderr

if TYPE_CHECKING:
    from llama_cpp import Llama

__all__ = ["GgufGenerator"]


class GgufGenerator:
    """One GGUF loaded once in llama.cpp, as a user runs it (llama.cpp's default f16 KV cache); greedy continuations.

    Args:
        path: the ``.gguf`` file.
        n_ctx: the longest prompt plus answer it will be asked for.
    """

    def __init__(self, path: str | Path, n_ctx: int = 512) -> None:
        self.n_ctx = n_ctx
        self.llm: Llama = load_llama(
            Path(path), n_ctx, f32_kv=False, why="answering with a GGUF in llama.cpp", otherwise=""
        )

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, stop: list[int]) -> tuple[list[int], float]:
        """The argmax continuation of ``prompt_ids`` (stop tokens excluded) and its tokens per second."""
        if len(prompt_ids) + max_new_tokens > self.n_ctx:
            max_new_tokens = max(0, self.n_ctx - len(prompt_ids))
        llm, out = self.llm, []
        llm.reset()
        start = time.perf_counter()
        with quiet_stderr():
            llm.eval(prompt_ids)
            for _ in range(max_new_tokens):
                nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                if nxt in stop:
                    break
                out.append(nxt)
                llm.eval([nxt])
        return out, len(out) / max(time.perf_counter() - start, 1e-9)

    def close(self) -> None:
        self.llm.close()
