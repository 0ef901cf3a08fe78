"""Quantization plans (a precision per tensor by role or glob), device profiles and memory estimates."""

from moetool.quant.devices import DEVICES, Device, estimate_memory, get_device
from moetool.quant.plan import PRESETS, QuantPlan, QuantSpec, TensorEntry, parse_quant, resolve
from moetool.quant.types import TYPES

__all__ = [
    "DEVICES",
    "PRESETS",
    "TYPES",
    "Device",
    "QuantPlan",
    "QuantSpec",
    "TensorEntry",
    "estimate_memory",
    "get_device",
    "parse_quant",
    "resolve",
]
