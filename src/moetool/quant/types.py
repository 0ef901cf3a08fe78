"""Precision types a plan can ask for, with their storage cost (data, no format library imported).

Names are llama.cpp's GGML type names in lower case, because GGUF is the one format with a type per tensor; graph
exporters map them to what their runtime has (``bits`` says how: 8 → int8, ≤ 6 → int4/int8 per target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionType:
    name: str
    bits: int  # nominal bits per weight (what "4-bit" means in a plan)
    block: int  # weights per quantization block (row length must be a multiple)
    block_bytes: int  # bytes per block, scales included
    python: bool  # gguf-py can quantize it; otherwise llama.cpp's quantizer is needed
    is_float: bool = False

    @property
    def bpw(self) -> float:
        """Stored bits per weight, scales included."""
        return 8 * self.block_bytes / self.block

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor of ``shape`` (rows along the last torch dim) stored in this type."""
        n = math.prod(shape)
        return n // self.block * self.block_bytes


_QK = 256
TYPES: dict[str, PrecisionType] = {
    t.name: t
    for t in (
        PrecisionType("f32", 32, 1, 4, True, is_float=True),
        PrecisionType("f16", 16, 1, 2, True, is_float=True),
        PrecisionType("bf16", 16, 1, 2, True, is_float=True),
        PrecisionType("q8_0", 8, 32, 34, True),
        PrecisionType("q6_k", 6, _QK, 2 + _QK // 2 + _QK // 4 + _QK // 16, False),
        PrecisionType("q5_1", 5, 32, 24, True),
        PrecisionType("q5_0", 5, 32, 22, True),
        PrecisionType("q5_k", 5, _QK, 4 + _QK // 2 + _QK // 8 + 12, False),
        PrecisionType("q4_1", 4, 32, 20, True),
        PrecisionType("q4_0", 4, 32, 18, True),
        PrecisionType("q4_k", 4, _QK, 4 + _QK // 2 + 12, False),
        PrecisionType("q3_k", 3, _QK, 2 + _QK // 4 + _QK // 8 + 12, False),
        PrecisionType("q2_k", 2, _QK, 4 + _QK // 16 + _QK // 4, False),
        # llama.cpp's importance-weighted ("IQ") types; block sizes and bytes are ggml's type traits
        PrecisionType("iq4_nl", 4, 32, 18, False),
        PrecisionType("iq4_xs", 4, _QK, 136, False),
        PrecisionType("iq3_s", 3, _QK, 110, False),
        PrecisionType("iq3_xxs", 3, _QK, 98, False),
        PrecisionType("iq2_s", 2, _QK, 82, False),
        PrecisionType("iq2_xs", 2, _QK, 74, False),
        PrecisionType("iq2_xxs", 2, _QK, 66, False),
    )
}

# Types written with an importance matrix only (moetool refuses them without one, as llama.cpp does for its 1-2 bit
# IQ types): below 4 bits a rounding blind to which columns matter costs too much, and the IQ grids are searched
# with importance weights by design.
NEEDS_IMATRIX: frozenset[str] = frozenset(
    n for n, t in TYPES.items() if n.startswith("iq") or (t.bits < 4 and not t.is_float)
)
# Types llama.cpp's quantizer rounds with importance weights when it has them (every K and IQ type, and the legacy
# 4- and 5-bit types; q8_0 and the float types ignore them).
IMATRIX_AWARE: frozenset[str] = frozenset(n for n, t in TYPES.items() if not t.is_float and n != "q8_0")

# llama.cpp's own fallback when a row length is not a multiple of the type's block (llama-quant.cpp,
# tensor_type_fallback): the 256-block K types drop to a 32-block type of similar quality.
FALLBACK: dict[str, str] = {
    "q6_k": "q8_0",
    "q5_k": "q5_1",
    "q4_k": "q5_0",
    "q3_k": "q4_0",
    "q2_k": "q4_0",
    "iq4_xs": "iq4_nl",
    "iq3_s": "iq4_nl",
    "iq3_xxs": "iq4_nl",
    "iq2_s": "iq4_nl",
    "iq2_xs": "iq4_nl",
    "iq2_xxs": "iq4_nl",
}


def get_type(name: str) -> PrecisionType:
    try:
        return TYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; known: {', '.join(TYPES)}") from None


def fit_type(name: str, row: int) -> tuple[str, str | None]:
    """The type actually usable for rows of length ``row``, and why it differs (or None).

    Follows llama.cpp: K types fall back to a 32-block type, anything still misaligned to f16.
    """
    t = get_type(name)
    if row % t.block == 0:
        return t.name, None
    alt = FALLBACK.get(t.name, "f16")
    if row % TYPES[alt].block:
        alt = "f16"
    return alt, f"row length {row} is not a multiple of {t.block} ({t.name}); llama.cpp's fallback is {alt}"
