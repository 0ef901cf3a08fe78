"""Device profiles: memory budget, formats in order of preference, precisions each format runs there.

Figures are for the device's RAM as sold; ``budget`` is what one app can count on after the OS (see ``note``).
The memory estimate is weights + KV cache at the profile's context + a runtime allowance; it is an estimate,
printed with its parts so a user can judge the margin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GB = 1000**3
MB = 1000**2

ALL_GGUF: tuple[str, ...] = (
    "f32",
    "f16",
    "bf16",
    "q8_0",
    "q6_k",
    "q5_1",
    "q5_0",
    "q5_k",
    "q4_1",
    "q4_0",
    "q4_k",
    "q3_k",
    "q2_k",
)
# what mlx-lm stores per weight: floats, or affine groups of N bits (export.mlx.names.MLX_PRECISIONS)
MLX_PRECISIONS: tuple[str, ...] = ("f32", "f16", "bf16", "8-bit", "6-bit", "5-bit", "4-bit", "3-bit", "2-bit")
GRAPH_PRECISIONS: tuple[str, ...] = (
    "fp32",
    "int8",
    "int4",
)  # what the graph runtimes (ONNX, TFLite, Core ML) store per weight


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    memory: int  # bytes of RAM
    budget: int  # bytes an app may use for the model
    formats: tuple[str, ...]  # preferred first
    # format → what its runtime runs there: GGUF type names, or fp32/int8/int4 for graph formats
    precisions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    context: int = 2048  # context length the estimate assumes
    ladder: tuple[str, ...] = ("f16", "q8_0", "moe-q5", "gem", "moe-q4", "q4_0")  # plans tried, best first
    note: str = ""

    def supports(self, fmt: str, type_name: str) -> bool:
        return type_name in self.precisions.get(fmt, ())

    def not_run(self, target: str) -> str | None:
        """Why this profile cannot take ``target`` (a format it does not run), in words; None where it runs it. The
        one fact a recipe's target and ``moetool export --for … --target …`` are both refused by."""
        if target in self.formats:
            return None
        return f"the deployment profile {self.name} runs {', '.join(self.formats)}, not {target}"


def _profile(name: str, description: str, *, memory: int, budget: int, formats: tuple[str, ...], **more: Any) -> Device:
    """A device whose runtimes run every precision their format stores: each GGUF type in llama.cpp, fp32, int8 and
    int4 weights in a graph runtime."""
    by_format = {"gguf": ALL_GGUF, "mlx": MLX_PRECISIONS}
    precisions = {f: by_format.get(f, GRAPH_PRECISIONS) for f in formats}
    return Device(name, description, memory, budget, formats, precisions, **more)


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        _profile(
            "raspberry-pi-4",
            "Raspberry Pi 4 Model B, 4 GB (Cortex-A72, no GPU compute)",
            memory=4 * GB,
            budget=int(3.2 * GB),
            formats=("gguf",),
            ladder=("q8_0", "moe-q5", "gem", "moe-q4", "q4_0"),  # f16 arithmetic is emulated on the A72
            note="64-bit Raspberry Pi OS Lite leaves about 3.2 GB; llama.cpp (NEON) runs every GGUF type",
        ),
        _profile(
            "pixel-6",
            "Google Pixel 6, 8 GB (Tensor G1)",
            memory=8 * GB,
            budget=4 * GB,
            formats=("tflite", "gguf"),
            note="Android's low-memory killer takes apps well before 8 GB; the NPU is native int8/fp16 only",
        ),
        _profile(
            "iphone-13",
            "Apple iPhone 13 Pro, 6 GB (A15)",
            memory=6 * GB,
            budget=int(4.2 * GB),
            formats=("coreml", "mlx", "gguf"),
            note="about 4.2 GB with the increased-memory-limit entitlement (GEM's figure); about 3 GB without",
        ),
        _profile(
            "mac-16gb",
            "Apple-silicon Mac (M1-M4), 16 GB unified memory",
            memory=16 * GB,
            budget=int(10.6 * GB),
            formats=("mlx", "gguf"),
            context=4096,
            ladder=("f16", "q8_0", "moe-q5", "gem", "moe-q4", "q4_0"),
            note="Metal's recommended working set is about two thirds of unified memory (10.7 GB of 16 GB): what "
            "MLX and llama.cpp's Metal backend allocate within",
        ),
        _profile(
            "laptop",
            "x86-64 or Apple-silicon laptop, 16 GB",
            memory=16 * GB,
            budget=12 * GB,
            formats=("gguf", "onnx"),
            context=4096,
            ladder=("f32", "f16", "q8_0", "moe-q5", "gem", "moe-q4", "q4_0"),
            note="leaves 4 GB to the OS and a browser",
        ),
    )
}


def get_device(name: str) -> Device:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}") from None


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.runtime


def estimate_memory(weights: int, config: dict[str, Any], context: int) -> MemoryEstimate:
    """Weights + f16 KV cache for ``context`` tokens + runtime (compute buffers, logits, a fixed allowance).

    Args:
        weights: bytes of the weights as planned.
        config: the model's config.json as a dict.
        context: tokens of context the app will use.
    """
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv = 2 * layers * kv_heads * head_dim * context * 2
    vocab = int(config["vocab_size"])
    hidden = int(config["hidden_size"])
    # llama.cpp's compute buffer at a 512-token batch is dominated by the logits and a few activations
    runtime = 64 * MB + 512 * vocab * 4 + 512 * hidden * 4 * 16
    return MemoryEstimate(weights=weights, kv_cache=kv, runtime=runtime)
