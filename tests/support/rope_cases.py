"""Scaled-rope configs for tiny models (head_dim 8: four frequencies, so every branch of each scheme is hit).

``ORIG`` is the original context; tests run one sequence inside it and one past it (``SHORT``, ``LONG``).
"""

from __future__ import annotations

from typing import Any

THETA = 10000.0
ORIG = 64
# longrope's switch must sit at or above llama.cpp's 256-rounded context to be testable inside it
LONGROPE_ORIG = 256
SHORT, LONG = 32, 300
MAX_POS = 512

ROPES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG},
    "yarn-attention": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": ORIG,
        "attention_factor": 1.3,
        "beta_fast": 16.0,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIG,
    },
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": LONGROPE_ORIG,
        "short_factor": [1.0, 1.3, 2.0, 3.0],
        "long_factor": [1.0, 2.5, 6.0, 9.0],
    },
}


def rope_kwargs(case: str) -> dict[str, Any]:
    """Config keyword arguments for ``case`` (rope_parameters and a max_position_embeddings past ``LONG``)."""
    rp = dict(ROPES[case]) | {"rope_theta": THETA}
    return {"rope_parameters": rp, "max_position_embeddings": 4 * LONGROPE_ORIG if case == "longrope" else MAX_POS}


def unscaled_kwargs() -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": THETA}}
