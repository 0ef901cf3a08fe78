"""Float32 arithmetic over a model held in 16 bits: each decoder layer's 16-bit tensors are upcast while it runs.

bf16 and f16 values are exact in float32, so upcasting a layer for its forward and casting it back loses nothing: the
logits equal a whole float32 model's, with memory for the 16-bit model plus one float32 layer. Two users:

- a verification reference (GGUF verification, the edit checks) must not carry rounding of its own, but a bf16 MoE of
  5B parameters is 21 GB in float32;
- router tuning of a 16-bit checkpoint on a CPU without a native 16-bit matmul (no AVX512-BF16 or AMX: PyTorch's
  fallback bf16 GEMM runs 10-20× slower than its float32 one there, :func:`native_matmul`). Training also keeps
  tensors for the backward pass; :meth:`Float32Arithmetic.saving` stores a reference to the 16-bit tensor in place of
  each saved upcast and upcasts it again when the backward pass reads it, so the float32 copy never outlives its
  layer's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import nn

from moetool.arch.facts import config_int

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = [
    "Float32Arithmetic",
    "decoder_layers",
    "float32_layer_by_layer",
    "float32_overhead",
    "layer_bytes",
    "native_matmul",
    "precision_of",
]

_SIXTEEN = (torch.bfloat16, torch.float16)
# what autograd keeps of a view of an upcast: its 16-bit source and the view's shape, stride and storage offset
_SavedView: TypeAlias = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], int | torch.SymInt]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the module list holding most of its parameters.

    Raises:
        ValueError: the model has no module list (nothing to run layer by layer).
    """
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no stack of layers to run one at a time")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def native_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """True when ``device`` multiplies ``dtype`` matrices at least as fast as float32 ones, by PyTorch's own test.

    Every CUDA device with the dtype; on a CPU, the condition under which PyTorch sends a 16-bit matmul to oneDNN
    (AVX512-BF16/AMX on x86, BF16 on ARM; FP16 needs AVX512-FP16 or AMX-FP16). Elsewhere it falls back to a generic
    GEMM: measured on an AVX2-only AMD EPYC, a bf16 ``[128, 960] @ [960, 960]`` took 17× the float32 one.
    """
    if dtype == torch.float32:
        return True
    if device.type == "cuda":
        return dtype != torch.bfloat16 or torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        mkldnn = torch.ops.mkldnn
        return bool(
            mkldnn._is_mkldnn_bf16_supported() if dtype == torch.bfloat16 else mkldnn._is_mkldnn_fp16_supported()
        )
    return True  # mps and the rest: their 16-bit path is their fast one


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _references(t: torch.Tensor) -> int:
    """How many tensors and views hold ``t``'s storage (PyTorch's own count; -1 where this build lacks it)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return int(count(t.untyped_storage()._cdata)) if count is not None else -1


class _Buffers:
    """Float32 buffers reused from layer to layer and step to step.

    A fresh allocation of a layer's worth of float32 is page-faulted in by the kernel: measured on a 2-core EPYC, a
    ``[4, 5120, 960]`` bf16 → float32 upcast into fresh memory took 206 ms, into a reused buffer 22 ms. A buffer is
    handed out again only when nothing but this pool holds its storage (PyTorch's use count), so a tensor still
    alive (an upcast the backward pass is reading) is never overwritten.
    """

    def __init__(self, per_shape: int = 4) -> None:
        self.per_shape = per_shape
        self._held: dict[tuple[int, ...], list[tuple[torch.Tensor, int]]] = {}

    def like(self, source: torch.Tensor) -> torch.Tensor:
        """A contiguous float32 tensor of ``source``'s shape and device (contents undefined)."""
        key = (*source.shape, hash(source.device))
        held = self._held.setdefault(key, [])
        for buf, alone in held:
            if alone >= 0 and _references(buf) <= alone:
                return buf
        buf = torch.empty(source.shape, dtype=torch.float32, device=source.device)
        if len(held) < self.per_shape:
            held.append((buf, _references(buf)))
        return buf

    def clear(self) -> None:
        self._held.clear()


class Float32Arithmetic:
    """Hooks that make a 16-bit ``model`` compute in float32, one decoder layer in float32 at a time.

    Everything 16-bit outside the layer stack (embeddings, final norm, head, rotary tables) becomes float32 at once,
    so hidden states, masks and position tables are float32 from the start. A forward pre-hook on each layer swaps
    its 16-bit parameters and buffers for float32 copies and a forward hook swaps the 16-bit ones back. Tensors that
    are float32 already (router tuning's trainable master weights) are never touched.

    A 16-bit parameter that requires a gradient is refused in a forward pass that records one: its gradient would
    be float32 while the parameter is not (keep trainable weights in float32).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = decoder_layers(model)
        self._live: dict[int, torch.Tensor] = {}  # storage of a live float32 upcast → its 16-bit source
        self._swapped: dict[int, list[tuple[nn.Module, str, torch.Tensor, bool]]] = {}
        self._handles: list[RemovableHandle] = []
        self._buffers = _Buffers()
        in_layers = {id(t) for t in self.layers.parameters()} | {id(t) for t in self.layers.buffers()}
        for module in model.modules():
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if id(t) in in_layers or t is None or t.dtype not in _SIXTEEN:
                    continue
                if isinstance(t, nn.Parameter):
                    t.data = t.data.float()  # in place: a tied head keeps sharing the embedding
                else:
                    setattr(module, name, t.float())
        for layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._up))
            self._handles.append(layer.register_forward_hook(self._down))
        model._moetool_float32_arithmetic = True  # type: ignore[assignment]  # read by precision_of

    def _up(self, layer: nn.Module, args: tuple[object, ...]) -> None:
        swapped = []
        for module in layer.modules():
            for name, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is None or t.dtype not in _SIXTEEN:
                    continue
                if t.requires_grad and torch.is_grad_enabled():
                    raise ValueError(
                        f"a trainable 16-bit parameter ({name} of {type(module).__name__}): keep it in float32"
                    )
                source = t.data if t.is_contiguous() else t.data.contiguous()
                wide = self._buffers.like(source).copy_(source)
                self._live[_storage(wide)] = source
                if isinstance(t, nn.Parameter):
                    swapped.append((module, name, t.data, True))
                    t.data = wide
                else:
                    swapped.append((module, name, t, False))
                    module._buffers[name] = wide
        self._swapped[id(layer)] = swapped

    def _down(self, layer: nn.Module, args: tuple[object, ...], output: object) -> None:
        for module, name, narrow, is_param in self._swapped.pop(id(layer), []):
            current = module._parameters[name] if is_param else module._buffers[name]
            assert current is not None
            self._live.pop(_storage(current.data), None)
            if is_param:
                current.data = narrow
            else:
                module._buffers[name] = narrow

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _SavedView:
        source = self._live.get(_storage(t)) if t.layout == torch.strided else None
        if source is None:
            return t
        # the upcast is contiguous like its source, so the saved view's geometry indexes the source alike
        return (source, tuple(t.shape), t.stride(), t.storage_offset())

    def _unpack(self, saved: torch.Tensor | _SavedView) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        source, shape, stride, offset = saved
        # the same view of a float32 copy laid out as the upcast was (so the backward's kernels see the strides a
        # float32 model's would); only the region the backward pass reads is upcast again
        wide = self._buffers.like(source).as_strided(shape, stride, offset)
        return wide.copy_(source.as_strided(shape, stride, source.storage_offset() + offset))

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around a forward pass whose backward will run: what autograd keeps of an upcast is its 16-bit source."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def remove(self) -> None:
        """Take the hooks off (the tensors outside the layer stack stay float32)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._buffers.clear()
        self.model.__dict__.pop("_moetool_float32_arithmetic", None)


def precision_of(model: nn.Module) -> tuple[torch.dtype, torch.dtype]:
    """``(storage, arithmetic)`` of ``model``: the dtype its decoder layers are held in and the one they compute in
    (float32 under :class:`Float32Arithmetic`)."""
    stream = getattr(model, "_moetool_stream", None)  # moetool.compute.stream: layers read in float32 from disk
    if stream is not None:
        return stream.storage, torch.float32
    try:
        storage = next(decoder_layers(model).parameters()).dtype
    except ValueError:  # no layer stack (a GEM or hybrid wrapper): nothing was upcast
        storage = next(model.parameters()).dtype
    return storage, torch.float32 if getattr(model, "_moetool_float32_arithmetic", False) else storage


def float32_layer_by_layer(model: nn.Module) -> nn.Module:
    """Make ``model`` compute in float32, holding one decoder layer in float32 at a time (a float32 model as it is).

    For inference (no backward pass; see :class:`Float32Arithmetic` for training). Returns ``model``, changed in
    place.
    """
    if all(p.dtype == torch.float32 for p in decoder_layers(model).parameters()):
        return model
    Float32Arithmetic(model)
    return model


def layer_bytes(config: Mapping[str, object], params: int) -> tuple[int, int]:
    """``(outside, one layer)`` in float32 bytes for a model of ``params`` parameters, from its ``config.json``: the
    embeddings (and an untied head) outside the layer stack, and one decoder layer's share of the rest."""
    text = config.get("text_config")
    c: Mapping[str, object] = text if isinstance(text, Mapping) and text else config
    embed = config_int(c, "vocab_size") * config_int(c, "hidden_size")
    outside = min(params, embed * (1 if c.get("tie_word_embeddings", True) else 2))
    layer = (params - outside) // max(1, config_int(c, "num_hidden_layers"))
    return outside * 4, layer * 4


def float32_overhead(params: int, config: Mapping[str, object]) -> int:
    """Bytes that :func:`float32_layer_by_layer` adds to a 16-bit model of ``params`` parameters: the embeddings and
    head in float32 instead of 16 bits, and one decoder layer's float32 copy while it runs (:func:`layer_bytes`)."""
    outside, layer = layer_bytes(config, params)
    return outside // 2 + layer
