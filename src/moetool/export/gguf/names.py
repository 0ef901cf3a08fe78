"""Hugging Face tensor names → GGUF tensor names (the maps are the records' data, ``moetool.arch.records``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from moetool.arch.records import GGUF_SPLIT_MAP, GGUF_TENSOR_MAP

if TYPE_CHECKING:
    import numpy as np

# the maps live with the records (moetool.arch.records): an output architecture's GGUF names come from its templates
_SPLIT = [(re.compile(p), t) for p, t in GGUF_SPLIT_MAP]
_COMPILED = [(re.compile(p), t) for p, t in GGUF_TENSOR_MAP]


def gguf_name(hf_name: str) -> tuple[str, int | None] | None:
    """GGUF name and expert index (for stacked expert tensors) of an HF tensor; None if it has no GGUF place."""
    for pat, tmpl in _COMPILED:
        m = pat.fullmatch(hf_name)
        if m:
            g = m.groupdict()
            e = g.pop("e", None)
            return tmpl.format(**{k: v for k, v in g.items() if v is not None}), None if e is None else int(e)
    return None


def split_names(hf_name: str) -> tuple[str, ...]:
    """The GGUF tensors an HF tensor splits into along its rows (see ``GGUF_SPLIT_MAP``); empty if it is not split."""
    for pat, templates in _SPLIT:
        m = pat.fullmatch(hf_name)
        if m:
            return tuple(t.format(**m.groupdict()) for t in templates)
    return ()


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half Q/K rows → the interleaved order of llama.cpp's NORM rope (as llama.cpp's converter).

    ``w``: [n_head·head_dim, ...] (weight or bias), numpy.
    """
    import numpy as np

    a = np.asarray(w)
    return a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
