"""How each weight of the traced structure is stored, and the graph rewrites that store it so: decided from the
plan and the structure alone, before any weight is read.

- A projection (``Transpose`` then ``MatMul``, or a ``Gemm`` with ``transB``) planned at 4 or 8 bits becomes
  onnxruntime's ``MatMulNBits`` (block 32, symmetric, int8 activations at :data:`~moetool.export.onnx.quantize.
  ACCURACY_LEVEL`), its weight packed by onnxruntime's own quantization kernel; in fp32 its weight is stored
  transposed and the ``Transpose`` dropped.
- The embedding ``Gather`` at 8 bits becomes int8 rows with a scale per block of 32 (standard ops), at 4 bits
  onnxruntime's ``GatherBlockQuantized``.
- A sparse MoE block (``com.microsoft.MoE``) whose experts the plan quantizes becomes ``QMoE``
  (:mod:`moetool.export.onnx.moe_op`).
- Everything else (norms, biases, rope tables, fp32 routers) is stored as it is.

Each stored weight is a :class:`Stored`: the ExportLM tensor it comes from, the form it takes and the
initializers (:class:`Piece`) it writes, in order. :mod:`moetool.export.onnx.weights` computes and writes them.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetool.export.onnx import quantize
from moetool.export.onnx.moe_op import SWIGLU
from moetool.export.onnx.quantize import BLOCK

if TYPE_CHECKING:
    from onnx import GraphProto, NodeProto

    from moetool.export.onnx.structure import Structure

_LAYER = re.compile(r"layers\.(\d+)\.")
FLOAT, UINT8, INT8, INT4, INT64 = 1, 2, 3, 22, 7  # onnx.TensorProto data types


@dataclass(frozen=True)
class Piece:
    """One initializer of the artifact: its name, onnx data type and dims."""

    name: str
    data_type: int
    dims: tuple[int, ...]


@dataclass(frozen=True)
class Stored:
    """How one ExportLM tensor (``source``) is stored: ``form`` is raw | transposed | nbits | gather8 | gather4 |
    qmoe, with ``bits`` and ``block`` for the quantized ones; ``pieces`` are the initializers, in the order the form
    computes them."""

    source: str
    form: str
    pieces: tuple[Piece, ...]
    bits: int = 0
    block: int | None = None

    @property
    def layer(self) -> int | None:
        """The decoder layer the source belongs to (None: outside the layer stack)."""
        m = _LAYER.match(self.source)
        return int(m.group(1)) if m else None


@dataclass
class Layout:
    """Every stored weight, the quantized nodes per precision, the MoE layers' experts quantized per precision, and
    notes on planned weights left in fp32."""

    stored: list[Stored] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"int8": 0, "int4": 0})
    experts: dict[str, int] = field(default_factory=lambda: {"int8": 0, "int4": 0})
    notes: list[str] = field(default_factory=list)
    accuracy_level: int = quantize.ACCURACY_LEVEL  # MatMulNBits' and QMoE's (quantize.ACCURACY_LEVELS)


def _attr(node: NodeProto, name: str, default: int | float) -> int | float:
    for a in node.attribute:
        if a.name == name:
            return float(a.f) if a.type == 1 else int(a.i)  # AttributeProto.FLOAT is 1
    return default


class _Graph:
    """The proto's nodes with the consumers of each value as traced. Each weight's consumers are rewritten once,
    by the one rewrite that reads them, so the map stays right for every weight still to be laid out."""

    def __init__(self, graph: GraphProto) -> None:
        self.graph = graph
        self.users: dict[str, list[NodeProto]] = defaultdict(list)
        for node in graph.node:
            for name in node.input:
                self.users[name].append(node)

    def replace(self, old: NodeProto, new: list[NodeProto]) -> None:
        at = list(self.graph.node).index(old)
        self.graph.node.remove(old)
        for i, n in enumerate(new):
            self.graph.node.insert(at + i, n)

    def drop(self, node: NodeProto) -> None:
        self.graph.node.remove(node)


def _nbits_node(
    name: str, a: str, out: str, weight: str, source: str, n: int, k: int, bits: int, accuracy: int
) -> tuple[NodeProto, Stored]:
    """``MatMulNBits(a)`` → ``out`` over ``weight`` [N, K] (from ExportLM's ``source``), and how it is stored."""
    from onnx import helper

    blocks = -(-k // BLOCK)
    pieces = (
        Piece(f"{weight}_Q{bits}", UINT8, (n, blocks, BLOCK * bits // 8)),
        Piece(f"{weight}_scales", FLOAT, (n, blocks)),
    )
    attrs: dict[str, int] = {"K": k, "N": n, "bits": bits, "block_size": BLOCK}
    if accuracy:
        attrs["accuracy_level"] = accuracy
    node = helper.make_node(
        "MatMulNBits", [a, pieces[0].name, pieces[1].name], [out], name=name, domain="com.microsoft"
    )
    node.attribute.extend(helper.make_attribute(key, value) for key, value in sorted(attrs.items()))
    return node, Stored(source, "nbits", pieces, bits=bits, block=BLOCK)


def _projection(g: _Graph, weight: str, source: str, shape: tuple[int, ...], p: str, out: Layout) -> bool:
    """A ``Transpose`` → ``MatMul`` projection; False when the weight is not consumed so."""
    users = g.users[weight]
    if len(users) != 1 or users[0].op_type != "Transpose" or len(shape) != 2:
        return False
    t = users[0]
    matmuls = g.users[t.output[0]]
    n, k = shape
    if p in ("int4", "int8") and matmuls and all(m.op_type == "MatMul" and m.input[1] == t.output[0] for m in matmuls):
        bits = 4 if p == "int4" else 8
        for m in matmuls:
            node, stored = _nbits_node(m.name, m.input[0], m.output[0], weight, source, n, k, bits, out.accuracy_level)
            g.replace(m, [node])
        out.stored.append(stored)
        out.counts[p] += len(matmuls)
    else:
        if p in ("int4", "int8"):
            out.notes.append(f"{source}: planned {p}, stored fp32 (not consumed by a MatMul)")
        name = f"{weight}.T"
        for m in matmuls:
            m.input[:] = [name if i == t.output[0] else i for i in m.input]
        out.stored.append(Stored(source, "transposed", (Piece(name, FLOAT, (k, n)),)))
    g.drop(t)
    return True


def _gemm(g: _Graph, weight: str, source: str, shape: tuple[int, ...], p: str, out: Layout) -> bool:
    """A ``Gemm`` over ``weight`` with ``transB`` (a router): MatMulNBits (plus its bias) when planned in bits."""
    from onnx import helper

    users = g.users[weight]
    if len(users) != 1 or users[0].op_type != "Gemm" or users[0].input[1] != weight:
        return False
    gemm = users[0]
    plain = _attr(gemm, "transB", 0) == 1 and _attr(gemm, "transA", 0) == 0 and _attr(gemm, "alpha", 1.0) == 1.0
    if p not in ("int4", "int8") or not plain or (len(gemm.input) > 2 and _attr(gemm, "beta", 1.0) != 1.0):
        if p in ("int4", "int8"):
            out.notes.append(f"{source}: planned {p}, stored fp32 (a Gemm MatMulNBits cannot replace)")
        out.stored.append(Stored(source, "raw", (Piece(weight, FLOAT, shape),)))
        return True
    bits = 4 if p == "int4" else 8
    bias = gemm.input[2] if len(gemm.input) > 2 and gemm.input[2] else None
    product = f"{gemm.output[0]}.nobias" if bias else gemm.output[0]
    node, stored = _nbits_node(
        gemm.name, gemm.input[0], product, weight, source, shape[0], shape[1], bits, out.accuracy_level
    )
    new = [node]
    if bias:
        new.append(helper.make_node("Add", [product, bias], [gemm.output[0]], name=f"{gemm.name}.bias"))
    g.replace(gemm, new)
    out.stored.append(stored)
    out.counts[p] += 1
    return True


def _gather(g: _Graph, weight: str, source: str, shape: tuple[int, ...], p: str, out: Layout) -> bool:
    """The embedding ``Gather`` (axis 0 over a [V, D] table) at 8 or 4 bits; False when not consumed so."""
    from onnx import helper

    users = g.users[weight]
    if len(users) != 1 or users[0].op_type != "Gather" or users[0].input[0] != weight or len(shape) != 2:
        return False
    node = users[0]
    v, d = shape
    if p not in ("int4", "int8") or _attr(node, "axis", 0) != 0 or (p == "int4" and d % BLOCK):
        if p in ("int4", "int8"):
            out.notes.append(f"{source}: planned {p}, stored fp32 (width {d} is not a multiple of {BLOCK})")
        out.stored.append(Stored(source, "raw", (Piece(weight, FLOAT, shape),)))
        return True
    block = BLOCK if d % BLOCK == 0 else d  # int8 rows: one scale per row when the width does not divide
    nb, ids, name, o = d // block, node.input[1], node.name, node.output[0]
    pieces: tuple[Piece, ...]
    if p == "int4":
        pieces = (Piece(f"{weight}_Q4", INT4, (v, d)), Piece(f"{weight}_scales", FLOAT, (v, nb)))
        new = [
            helper.make_node(
                "GatherBlockQuantized",
                [pieces[0].name, ids, pieces[1].name],
                [o],
                name=name,
                domain="com.microsoft",
                gather_axis=0,
                quantize_axis=1,
                block_size=BLOCK,
            )
        ]
    else:
        pieces = (
            Piece(f"{weight}.int8", INT8, (v, nb, block)),
            Piece(f"{weight}.scale", FLOAT, (v, nb, 1)),
            Piece(f"{name}.width", INT64, (1,)),
        )
        new = quantize.gather_int8_nodes(name, pieces[0].name, pieces[1].name, pieces[2].name, ids, o)
    g.replace(node, new)
    form, bits = ("gather4", 4) if p == "int4" else ("gather8", 8)
    out.stored.append(Stored(source, form, pieces, bits=bits, block=block))
    out.counts[p] += 1
    return True


def _moe(g: _Graph, node: NodeProto, st: Structure, precisions: dict[str, str], out: Layout) -> None:
    """One ``com.microsoft.MoE`` node: QMoE when the plan quantizes its layer's experts, else fp32 as traced."""
    from onnx import helper

    fc1, fc2 = node.input[2], node.input[4]
    (s1, src1), (s2, src2) = st.weights[fc1], st.weights[fc2]
    layer = src1.rsplit(".", 1)[0]  # "layers.N.mlp"
    wanted = {p for name, p in precisions.items() if name.startswith(f"{layer}.experts.")}
    precision = "fp32" if not wanted or "fp32" in wanted else "int8" if "int8" in wanted else "int4"
    if len(wanted) > 1:
        out.notes.append(f"{layer}: experts planned {sorted(wanted)}; QMoE takes one precision per layer: {precision}")
    if precision == "fp32":
        out.stored += [Stored(src1, "raw", (Piece(fc1, FLOAT, s1),)), Stored(src2, "raw", (Piece(fc2, FLOAT, s2),))]
        return
    bits = 8 if precision == "int8" else 4
    divisible = s1[2] % BLOCK == 0 and s2[2] % BLOCK == 0
    # 8-bit blocks take onnxruntime's int8-activation kernel (fast, not exact); per row is exact but slow, so
    # 8-bit experts are per row only when activations stay fp32 (accuracy level 0)
    block = BLOCK if divisible and (bits == 4 or out.accuracy_level > 0) else None
    if block is None and not divisible:
        out.notes.append(f"{layer}: widths not multiples of {BLOCK}: {bits}-bit experts with one scale per row")
    names: list[str] = []
    for tag, src, (e, n, k) in (("fc1", src1, s1), ("fc2", src2, s2)):
        scales = (e, n) if block is None else (e, n, k // block)
        pieces = (
            Piece(f"{node.name}.{tag}.q", UINT8, (e, n, k * bits // 8)),
            Piece(f"{node.name}.{tag}.scale", FLOAT, scales),
        )
        out.stored.append(Stored(src, "qmoe", pieces, bits=bits, block=block))
        names += [p.name for p in pieces]
    attrs: dict[str, int | str] = {
        "k": int(_attr(node, "k", 1)),
        "normalize_routing_weights": int(_attr(node, "normalize_routing_weights", 0)),
        "expert_weight_bits": bits,
        "accuracy_level": out.accuracy_level,
        **SWIGLU,
    }
    if block is not None:
        attrs["block_size"] = block
    # QMoE ignores normalize_routing_weights=0 unless router_weights (the softmax of the logits) is given
    probs = f"{node.name}.router_weights"
    x, logits = node.input[0], node.input[1]
    inputs = [x, logits, names[0], names[1], "", names[2], names[3], "", "", "", "", "", "", "", probs]
    softmax = helper.make_node("Softmax", [logits], [probs], name=f"{node.name}.softmax", axis=-1)
    qmoe = helper.make_node("QMoE", inputs, list(node.output), name=node.name, domain="com.microsoft")
    qmoe.attribute.extend(helper.make_attribute(key, value) for key, value in sorted(attrs.items()))
    g.replace(node, [softmax, qmoe])
    out.experts[precision] += e


def lay_out(st: Structure, precisions: dict[str, str], accuracy_level: int = quantize.ACCURACY_LEVEL) -> Layout:
    """Decide how every weight of ``st`` is stored under ``precisions`` (export name → fp32 | int8 | int4) and
    rewrite ``st.model``'s graph in place to match; its 4- and 8-bit operators compute at ``accuracy_level``
    (default :data:`moetool.export.onnx.quantize.ACCURACY_LEVEL`)."""
    g = _Graph(st.model.graph)
    out = Layout(accuracy_level=accuracy_level)
    for node in [n for n in g.graph.node if n.op_type == "MoE" and n.domain == "com.microsoft"]:
        _moe(g, node, st, precisions, out)
    experts = {s.source for s in out.stored}
    for weight, (shape, source) in st.weights.items():
        if source in experts:
            continue
        p = precisions.get(source, "fp32")
        if not any(f(g, weight, source, shape, p, out) for f in (_projection, _gemm, _gather)):
            if p in ("int4", "int8") and len(shape) == 2:
                out.notes.append(f"{source}: planned {p}, stored fp32 (not a projection or an embedding)")
            out.stored.append(Stored(source, "raw", (Piece(weight, FLOAT, shape),)))
    return out
