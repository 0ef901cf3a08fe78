"""The ONNX decoder's structure without its weights: :class:`~moetool.export.onnx.decoder.OnnxDecoder` over an
ExportLM built on PyTorch's ``meta`` device, traced by torch.onnx's dynamo exporter with meta inputs.

Nothing is read and no weight is held: the trace sees shapes only. The graph optimiser runs after the weights'
values are dropped from the traced initializers, so it folds and fuses what does not depend on them (shapes, casts,
the mask) and leaves every weight a named, value-less initializer, consumed as the trace wrote it: ``Transpose`` then
``MatMul`` for a projection, ``Gemm`` for a router, ``Gather`` for the embedding, ``MoE`` for a sparse block.
:mod:`moetool.export.onnx.weights` decides how each is stored and writes them one layer at a time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moetool.export.graph.common import meta_export_model
from moetool.export.onnx.decoder import SCOPE, OnnxDecoder, name_dims, past_names

if TYPE_CHECKING:
    from onnx import ModelProto

    from moetool.export.graph.model import ExportLM


@dataclass
class Structure:
    """The graph without weights, and each weight initializer it names: name → (shape, source), where the source is
    the ExportLM parameter or buffer (``layers.0.attn.q.weight``, ``layers.0.mlp.fc1``) whose values it takes."""

    model: ModelProto
    weights: dict[str, tuple[tuple[int, ...], str]]
    em: ExportLM  # on meta: the names, shapes and attention facts the runner files read

    @property
    def n_layers(self) -> int:
        return self.em.n_layers

    @property
    def sparse_layers(self) -> int:
        """MoE blocks traced as the sparse op (``com.microsoft.MoE`` nodes)."""
        return self.em.sparse_moe_layers()


@contextlib.contextmanager
def _quiet_optimizer() -> Iterator[None]:
    """The optimiser and the serialiser warn once per value-less initializer: expected here."""
    log = logging.getLogger("onnx_ir")
    was = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(was)


def trace_structure(config: Mapping[str, Any], *, sparse: bool) -> Structure:
    """Trace the decoder of ``config`` (a ``config.json``) on ``meta``; see the module docstring.

    Every batch and length dimension is dynamic, traced with an example past of 3 positions so none is
    specialised to 0 or 1 (an empty past runs too), and named after the roles the inputs give them.
    """
    import onnx_ir as ir
    import onnxscript

    from moetool.export.onnx.moe_op import translation_table

    em = meta_export_model(config).eval()
    if sparse:
        em.make_sparse()
    n = em.n_layers
    b, t, p = 2, 4, 3
    meta = torch.device("meta")
    ids = torch.zeros(b, t, dtype=torch.long, device=meta)
    mask = torch.ones(b, p + t, dtype=torch.long, device=meta)
    pos = torch.zeros(b, t, dtype=torch.long, device=meta)
    past = [torch.zeros(b, em.n_kv, p, em.head_dim, device=meta) for _ in range(2 * n)]
    auto = torch.export.Dim.AUTO
    program = torch.onnx.export(
        OnnxDecoder(em).eval(),
        (ids, mask, pos, *past),
        None,
        dynamo=True,
        optimize=False,  # below, once the weights' (meta) values are gone: folding would try to read them
        verbose=False,
        input_names=["input_ids", "attention_mask", "position_ids", *past_names(n)],
        output_names=["logits", *past_names(n, "present")],
        dynamic_shapes=(
            {0: auto, 1: auto},
            {0: auto, 1: auto},
            {0: auto, 1: auto},
            tuple({0: auto, 2: auto} for _ in past),
        ),
        custom_translation_table=translation_table() if sparse else None,
    )
    assert program is not None
    model: ir.Model = program.model
    sources = {SCOPE + name: name for name, _ in [*em.named_parameters(), *em.named_buffers()]}
    weights: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, value in model.graph.initializers.items():
        if name not in sources:
            raise RuntimeError(f"the traced graph holds an initializer the export model does not name: {name}")
        assert value.shape is not None
        weights[name] = (tuple(int(d) for d in value.shape.numpy()), sources[name])  # static: weights
        value.const_value = None
    with _quiet_optimizer():
        onnxscript.optimizer.optimize_ir(model)
        proto = ir.serde.serialize_model(model)  # warns once per value-less initializer, which it leaves out
    for node in proto.graph.node:  # trace metadata: stack traces with local paths
        del node.metadata_props[:]
    name_dims(proto)
    used = {i for node in proto.graph.node for i in node.input}
    return Structure(
        model=proto,
        weights={k: v for k, v in weights.items() if k in used},
        em=em,
    )
