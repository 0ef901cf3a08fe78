"""A causal LM whose decoder layers stay on disk: each is read from the safetensors when it runs and dropped after.

Evaluation and verification of a model larger than memory (four 7B experts are 48 GB in bf16) need every layer once
per forward pass, never all at once. :func:`streamed_causal_lm` builds the model's structure on PyTorch's ``meta``
device (no memory), loads what lies outside the layer stack (embeddings, final norm, head, rotary tables), and puts a
pre-hook on each decoder layer that reads its tensors from the checkpoint and a hook that drops them when the layer
returns. Memory: the outside weights and one layer, plus the activations; what a model holds is counted by
:func:`moetool.compute.stream_bytes.streamed_weight_bytes`.

The tensors are read through transformers' own loading (its checkpoint-to-module renames and conversions, such as
transformers 5's fused MoE experts) so a layer holds what ``from_pretrained`` would give it. The arithmetic is
float32: most tensors are cast to float32 as they are read, while the expert stacks, the embedding and the head stay
in their stored 16 bits and are upcast a piece at a time as they compute (:mod:`moetool.compute.narrow`). bf16 and
f16 values are exact in float32, so the logits equal a resident float32 model's. Files are read with ``pread``, not
mapped, so pages of layers already run do not stay in the process's resident set.

A forward pass reads the whole checkpoint: run as many sequences per pass as memory allows (:class:`Stream` records
the passes and bytes read, for the reports).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from moetool.compute.narrow import SIXTEEN, compute_by_expert, expert_stacks, narrow_names, upcast_outside
from moetool.compute.rows import FF_ROWS, feed_forward, run_in_rows
from moetool.compute.upcast import decoder_layers, layer_bytes
from moetool.errors import MoetoolError
from moetool.io.checkpoint import SAFETENSORS_TAG_BYTES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from moetool.compute.placement import Placement

__all__ = [
    "CheckpointLoader",
    "MetaModel",
    "NonFiniteModel",
    "Stream",
    "TensorSlice",
    "TensorSource",
    "give_back_freed_memory",
    "layer_bytes",
    "meta_causal_lm",
    "quiet_transformers",
    "release_models",
    "stream_of",
    "streamed_causal_lm",
]


class NonFiniteModel(MoetoolError):
    """A model whose weights or logits hold NaN or Inf: any figure computed from it would be meaningless."""


@dataclass
class Stream:
    """What a streamed model read: the checkpoint it reads from, the dtype its weights are stored in, and the count
    of layers loaded and bytes read (as stored) since it was built."""

    path: Path
    storage: torch.dtype
    layers: int
    loads: int = 0
    bytes_read: int = 0
    _keys: dict[int, list[str]] = field(default_factory=dict, repr=False)

    @property
    def passes(self) -> float:
        """Whole-model reads so far: layer loads over the number of layers."""
        return self.loads / max(1, self.layers)


def stream_of(model: nn.Module) -> Stream | None:
    """The :class:`Stream` of a model built by :func:`streamed_causal_lm`, or None for a resident model."""
    found = getattr(model, "_moetool_stream", None)
    return found if isinstance(found, Stream) else None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and info logs (its loading bar, its load report) off: a streamed model loads one
    layer per forward pass, and the zoo reports its own progress."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    level = logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if was:
            logging.enable_progress_bar()


class TensorSlice(Protocol):
    """One tensor not read yet, as a safetensors slice: its shape and stored dtype tag (``BF16``), read when indexed
    (``[...]``)."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...

    def __getitem__(self, index: object) -> torch.Tensor: ...


class TensorSource(Protocol):
    """Named tensors read on demand, as a safetensors handle gives them: ``get_slice(name)[...]`` is the tensor."""

    def keys(self) -> list[str]: ...

    def get_slice(self, name: str) -> TensorSlice: ...


class CheckpointLoader:
    """Reads named checkpoint tensors into ``model`` through transformers' conversions, cast to ``dtype``: from the
    safetensors in ``path``, or from ``tensors`` (under the same names) where given.

    Where the conversion only renames, stacks experts or concatenates them (:mod:`moetool.compute.placement`), each
    parameter is allocated once and every tensor copied into its place as it is read; transformers' loader does the
    rest. Either way the parameters are those ``from_pretrained`` gives."""

    def __init__(
        self,
        model: PreTrainedModel,
        path: Path,
        dtype: torch.dtype = torch.float32,
        tensors: TensorSource | None = None,
    ) -> None:
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.modeling_utils import LoadStateDictConfig

        self.model = model
        handles: list[TensorSource] = [tensors] if tensors is not None else []
        if tensors is None:
            files = sorted(Path(path).glob("*.safetensors"))
            if not files:
                raise MoetoolError(f"{path}: no safetensors files to stream the layers from")
            handles = [safe_open(str(f), framework="pt", device="cpu", backend="pread") for f in files]
        self._handles = handles
        self.where = {k: h for h in handles for k in h.keys()}  # noqa: SIM118  (safe_open is not a Mapping)
        conversions = get_model_conversion_mapping(model, None, None)
        self._conversions: list[object] = list(conversions)
        self._meta = model.state_dict()  # names and shapes, before any tensor is read (on meta: no memory)
        self._dtype = dtype
        # parameters held as the checkpoint stores them when that is 16 bits (moetool.compute.narrow), not in dtype
        self.narrow: set[str] = set()
        # transformers annotates the mapping it builds more widely than the field it feeds
        self._config = LoadStateDictConfig(dtype=dtype, weight_mapping=conversions)  # type: ignore[arg-type]

    def plan(self, keys: list[str]) -> tuple[dict[str, TensorSlice], dict[str, int], Placement]:
        """For ``keys`` (checkpoint names), before anything is read: their slices, their bytes as stored, and where
        each lands (:func:`moetool.compute.placement.place`; the rest left to transformers' conversions)."""
        from moetool.compute.placement import place

        slices = {k: self.where[k].get_slice(k) for k in keys}
        shapes = {k: tuple(int(d) for d in s.get_shape()) for k, s in slices.items()}
        stored = {k: math.prod(shapes[k]) * SAFETENSORS_TAG_BYTES.get(s.get_dtype(), 4) for k, s in slices.items()}
        return slices, stored, place(self.model, shapes, self._conversions, self._meta)

    def held_dtype(self, target: str, sources: list[TensorSlice]) -> torch.dtype:
        """The dtype parameter ``target`` is held in: its sources' own where it is narrow and they are all one 16-bit
        dtype (exact in float32), else the loader's."""
        stored = {s.get_dtype() for s in sources}
        if target in self.narrow and len(stored) == 1 and (tag := stored.pop()) in SIXTEEN:
            return SIXTEEN[tag]
        return self._dtype

    def target_shape(self, target: str) -> tuple[int, ...]:
        """The shape of the model's parameter or buffer ``target``, known before anything is read."""
        return tuple(self._meta[target].shape)

    def load(self, keys: list[str]) -> int:
        """Load ``keys`` (checkpoint names) into the model; returns the bytes read as stored.

        Raises:
            NonFiniteModel: a tensor holds NaN or Inf (named).
        """
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        from moetool.compute.placement import set_parameter

        slices, stored, placement = self.plan(keys)
        read = sum(stored.values())
        for target, regions in placement.targets.items():
            value = torch.empty(
                self._meta[target].shape, dtype=self.held_dtype(target, [slices[k] for k, _ in regions])
            )
            for key, region in regions:
                value[region].copy_(slices[key][...])  # read as stored, cast as it is copied
            set_parameter(self.model, target, value)
        if placement.rest:
            rest = {k: slices[k] for k in placement.rest}
            with quiet_transformers():
                convert_and_load_state_dict_in_model(model=self.model, state_dict=rest, load_config=self._config)
        return read


@dataclass
class MetaModel:
    """A causal LM built on ``meta`` (no memory) with a loader for its checkpoint: the checkpoint names of each
    decoder layer's tensors (``layer_keys[i]``) and of those outside the layer stack (``outside``)."""

    path: Path
    model: PreTrainedModel
    layers: nn.ModuleList
    prefix: str  # the layer stack's module name, ``model.layers``
    loader: CheckpointLoader
    layer_keys: dict[int, list[str]]
    outside: list[str]

    def load_outside(self) -> int:
        """Read everything outside the layer stack onto the CPU (rotary tables computed, tied weights tied);
        returns the bytes read.

        Raises:
            MoetoolError: the checkpoint does not hold a parameter outside the layers.
        """
        read = self.loader.load(self.outside)
        for name, module in self.model.named_modules():  # rotary tables: buffers computed at construction, on meta
            if module is self.layers or name.startswith(self.prefix + "."):
                continue
            if any(b.is_meta for b in module.buffers(recurse=False)):
                module.to_empty(device="cpu", recurse=False)
                self.model._init_weights(module)
        self.model.tie_weights()
        inside = self.prefix + "."
        missing = [n for n, p in self.model.named_parameters() if p.is_meta and not n.startswith(inside)]
        if missing:
            raise MoetoolError(f"{self.path}: the checkpoint does not hold {missing[0]} (and {len(missing) - 1} more)")
        return read


def meta_causal_lm(
    path: Path, dtype: torch.dtype = torch.float32, tensors: TensorSource | None = None, **model_kwargs: str
) -> MetaModel:
    """The causal LM in ``path`` built on ``meta``, its tensors to be read (cast to ``dtype``) part by part from its
    safetensors, or from ``tensors`` where given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    layers = decoder_layers(model)
    prefix = str(next(name for name, m in model.named_modules() if m is layers))
    loader = CheckpointLoader(model, Path(path), dtype, tensors)
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    layer_keys: dict[int, list[str]] = {}
    outside: list[str] = []
    for key in loader.where:
        m = pattern.match(key)
        if m:
            layer_keys.setdefault(int(m.group(1)), []).append(key)
        else:
            outside.append(key)
    return MetaModel(Path(path), model, layers, prefix, loader, layer_keys, outside)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to ask
        return None


def release_models() -> None:
    """Free the models no longer referenced now, and give their memory back (:func:`give_back_freed_memory`). A
    streamed model's layer hooks refer to its loader, which refers to the model: a reference cycle, which only the
    cycle collector frees, at a time of its choosing. Measured on a 2-layer slice of the 7B rung, the GGUF
    verification's streamed reference kept 1.3 GB alive through the artifact pass after it."""
    gc.collect()
    give_back_freed_memory()


def give_back_freed_memory() -> None:
    """Ask glibc to return the memory of freed tensors to the system. A layer's tensors are built from many pieces
    below glibc's mmap threshold (per-expert slices, their casts, the stacks), which stay in the heap once freed and
    fragment it: measured on the size ladder's 360M rung, a streamed forward peaked at 1.47-1.73 GB without this and
    1.02-1.04 GB with it. A no-op where the C library is not glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _check_finite(module: nn.Module, where: str) -> None:
    """Raise :class:`NonFiniteModel` naming the first loaded floating-point weight of ``module`` holding NaN or Inf
    (weights still on ``meta``, not yet read, are skipped)."""
    for name, p in module.named_parameters():
        if p.is_meta or not p.is_floating_point() or not p.numel():
            continue
        # in pieces: isfinite of a whole tensor makes a float copy and two masks of it, which measured 3.3 GB of
        # transient memory over a four-expert layer of Mistral-7B's shape (3.0 GB of weights)
        if not all(bool(torch.isfinite(part).all()) for part in p.detach().reshape(-1).split(1 << 22)):
            raise NonFiniteModel(f"weight {where}{name} holds NaN or Inf values")


def streamed_causal_lm(
    path: Path,
    *,
    storage: torch.dtype = torch.bfloat16,
    check_finite: bool = True,
    tensors: TensorSource | None = None,
    ff_rows: int | None = FF_ROWS,
    **model_kwargs: str,
) -> PreTrainedModel:
    """The causal LM in ``path`` (a ``save_pretrained`` folder of safetensors) with its decoder layers streamed from
    disk in float32, on the CPU, in eval mode; its weights read from ``tensors`` instead of the folder's safetensors
    where given (the folder still gives the config). ``storage`` is the dtype the checkpoint holds (for the reports);
    ``model_kwargs`` go to ``from_config`` as to ``from_pretrained`` (``experts_implementation="eager"``).

    ``model(input_ids=[B, T]).logits`` is ``[B, T, V]`` as a resident float32 model's. Expert stacks, the embedding
    and the head are held as stored when that is 16 bits and upcast a piece at a time as they compute
    (:mod:`moetool.compute.narrow`): the experts then run transformers' eager loop, whatever implementation
    ``model_kwargs`` name (the same float32 arithmetic; a grouped kernel's sums differ by rounding). With
    ``check_finite`` each
    tensor is checked for NaN and Inf as it is read (:class:`NonFiniteModel`). :func:`stream_of` gives the model's
    :class:`Stream`.

    Each layer's feed-forward block runs ``ff_rows`` positions at a time (:func:`moetool.compute.rows.run_in_rows`;
    None: all at once): a pass reads the checkpoint once however many windows it runs, so its activations should
    not grow with them either.

    Raises:
        MoetoolError: no safetensors in ``path``, or checkpoint tensors the model does not place.
    """
    path = Path(path)
    meta = meta_causal_lm(path, torch.float32, tensors, **model_kwargs)
    model, layers, prefix, loader = meta.model, meta.layers, meta.prefix, meta.loader
    model.eval()
    stream = Stream(path=path, storage=storage, layers=len(layers))
    stream._keys = meta.layer_keys
    loader.narrow = narrow_names(model)
    for experts in expert_stacks(model).values():
        compute_by_expert(experts)
    stream.bytes_read += meta.load_outside()
    upcast_outside(model)
    if check_finite:
        _check_finite(model, "")

    def up(index: int) -> None:
        keys = stream._keys.get(index, [])
        stream.bytes_read += loader.load(keys)
        stream.loads += 1
        if check_finite:
            _check_finite(layers[index], f"{prefix}.{index}.")

    def down(layer: nn.Module, _args: object, _out: object) -> None:
        layer.to("meta")  # drop the layer's weights once it has run (a hook's return would replace the output)
        give_back_freed_memory()

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: up(i))
        layer.register_forward_hook(down)
        block = feed_forward(layer)
        if ff_rows is not None and block is not None:
            run_in_rows(block, ff_rows)
    model.__dict__["_moetool_stream"] = stream  # read by stream_of (a plain attribute, not a submodule)
    return model
