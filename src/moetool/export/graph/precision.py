"""Plan types → what graph runtimes store: fp32, int8 or int4 weights (blockwise where the runtime can)."""

from __future__ import annotations

from moetool.quant.types import get_type

GRAPH_PRECISIONS = ("fp32", "int8", "int4")


def graph_precision(type_name: str) -> str:
    """f32 → fp32; 5–8-bit types → int8; ≤4-bit → int4. f16/bf16 weights are not offered by the graph exporters."""
    t = get_type(type_name)
    if t.name == "f32":
        return "fp32"
    if t.is_float:
        raise ValueError(f"{t.name} weights: graph targets take f32, 8-bit or 4-bit weights (use f32 or q8_0)")
    return "int8" if t.bits >= 5 else "int4"


def symmetric(type_name: str) -> bool:
    """q*_0 and K types are symmetric in spirit; q4_1/q5_1 carry a minimum (asymmetric)."""
    return not type_name.endswith("_1")
