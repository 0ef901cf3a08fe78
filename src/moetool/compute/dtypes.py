"""The dtype and device a stage computes in, by the names every command takes (``--dtype``, ``--device``).

Here, below the stages, so that eval, edit, export and training resolve them alike without importing each other.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from moetool.errors import MoetoolError
from moetool.io.checkpoint import SAFETENSORS_DTYPES, Checkpoint

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``bfloat16``: how config.json, manifests and messages name a dtype."""
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype a checkpoint's floating-point weights are stored in: config.json's ``dtype`` (or ``torch_dtype``),
    else the most common float dtype of its safetensors headers, else float32."""
    ck = Checkpoint(Path(model_dir))
    named = ck.config.get("dtype") or ck.config.get("torch_dtype")
    if isinstance(named, str) and named in DTYPES:
        return named
    counts: Counter[str] = Counter()
    for info in ck.tensors.values():
        tag = SAFETENSORS_DTYPES.get(info.dtype)
        name = _NAMES.get(tag[0]) if tag else None
        if name:
            counts[name] += info.numel
    return counts.most_common(1)[0][0] if counts else "float32"


def resolve_dtype(requested: str | None, model_dir: Path) -> torch.dtype:
    """``requested`` (float32, bfloat16, float16), or the checkpoint's own dtype for None or ``auto``.

    Raises:
        MoetoolError: an unknown dtype name.
    """
    name = checkpoint_dtype(model_dir) if requested in (None, "auto") else str(requested)
    if name not in DTYPES:
        raise MoetoolError(f"--dtype {requested!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(requested: str | None) -> torch.device:
    """``auto`` (or None): the first CUDA device when there is one, else the CPU; ``cpu``; ``cuda`` or ``cuda:N``.

    Raises:
        MoetoolError: an unknown device, or CUDA asked for where there is none (or not that many).
    """
    if requested is not None and not requested.strip():
        # an empty value is a mistake (an unset shell variable), not a request for the default
        raise MoetoolError("--device is empty: choose auto, cpu, cuda or cuda:N (or leave the option out)")
    text = (requested or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        index = text.partition(":")[2]
        if index and not index.isdigit():
            raise MoetoolError(f"--device {requested!r}: write cuda or cuda:N")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (index and int(index) >= count):
            raise MoetoolError(
                f"--device {requested}: this machine has {count} CUDA device(s); use --device cpu (or auto)"
            )
        return torch.device(text)
    raise MoetoolError(f"--device {requested!r}: choose auto, cpu, cuda or cuda:N")
