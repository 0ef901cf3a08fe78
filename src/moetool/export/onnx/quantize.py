"""Weight quantization of a traced ONNX graph per the plan: MatMuls through onnxruntime's ``MatMulNBits`` (4 or 8
bits, block 32), an embedding ``Gather`` at 4 bits through its ``GatherBlockQuantized`` and at 8 bits as int8 rows
with a per-block scale (standard ops; onnxruntime's quantizer stores Gather tables at 4 bits only)."""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from onnx import ModelProto, NodeProto

BLOCK = 32
# MatMulNBits/QMoE compute with int8 activations (as llama.cpp's q8_0 and k-quant dot products do): on this 2-core
# CPU the real SmolLM2 MoE decodes 24x faster than at level 0 (fp32 activations, weights dequantized every call);
# parity reports what it costs. Tests set 0 to check the weight layout exactly.
ACCURACY_LEVEL = 4
# the levels an export takes (``--accuracy-level``), and what each computes its activations in
ACCURACY_LEVELS = {
    0: "fp32 (the 4/8-bit weights dequantized in each call: exact to the rounded weights, slower)",
    4: "int8 (each row of activations quantized per block, as llama.cpp's dot products do: fast)",
}
_QUANTIZABLE = ("MatMul", "Gather")


def module_of(node: NodeProto) -> str | None:
    """The ExportLM module a node was traced from (the dynamo exporter records its name scopes)."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = ast.literal_eval(prop.value)
            return str(scopes[-2]) if len(scopes) >= 2 else None
    return None


def _planned(model: ModelProto, precisions: dict[str, str], scope: str) -> dict[str, list[NodeProto]]:
    groups: dict[str, list[NodeProto]] = {"int8": [], "int4": []}
    for node in model.graph.node:
        if node.op_type in _QUANTIZABLE:
            module = module_of(node)
            p = precisions.get(f"{module.removeprefix(scope)}.weight") if module else None
            if p in groups:
                groups[p].append(node)
    return groups


def quantize_graph(
    path: Path,
    precisions: dict[str, str],
    scope: str = "",
    before: Callable[[ModelProto], list[str]] | None = None,
) -> tuple[dict[str, int], list[str]]:
    """Quantize MatMul/Gather weights in place per ``precisions`` (export parameter name → fp32 | int8 | int4);
    ``scope`` is the traced module's prefix before those names (``em.`` for a wrapper whose ``em`` is ExportLM);
    ``before(model)`` runs first, while the trace metadata is there, and returns notes (the sparse MoE's QMoE).

    Returns nodes quantized per precision, and notes on planned nodes left in fp32 (a weight that is not a constant
    table, or one onnxruntime's quantizer declined).
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    chatty = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    if chatty.level == logging.NOTSET:  # a line per graph node at INFO (its module sets up root logging) unless asked
        chatty.setLevel(logging.WARNING)
    model = onnx.load(str(path))
    first = before(model) if before is not None else []
    groups = _planned(model, precisions, scope)
    names = {k: [n.name for n in v] for k, v in groups.items()}
    own8 = {n.name for n in groups["int8"] if n.op_type == "Gather"}
    done8 = gather_int8(model, own8)
    for bits, key in ((4, "int4"), (8, "int8")):
        wanted = [n for n in names[key] if n not in own8]
        if wanted:
            # nodes_to_include only adds to op_types_to_quantize; exclusion is what restricts a pass
            others = [n.name for n in model.graph.node if n.op_type in _QUANTIZABLE and n.name not in wanted]
            q = MatMulNBitsQuantizer(
                model,
                bits=bits,
                block_size=BLOCK,
                is_symmetric=True,
                nodes_to_exclude=others,
                op_types_to_quantize=_QUANTIZABLE,
                accuracy_level=ACCURACY_LEVEL,
            )
            q.process()
            model = q.model.model
    for node in model.graph.node:  # trace metadata (stack traces with local paths) is only needed up to here
        del node.metadata_props[:]
    save_model(model, path)
    left = {n.name for n in model.graph.node if n.op_type in _QUANTIZABLE} - done8
    done = {k: len([n for n in v if n not in left]) for k, v in names.items()}
    notes = [
        f"{n} planned {k} but left fp32 by onnxruntime's quantizer" for k, v in names.items() for n in v if n in left
    ]
    return done, first + notes


def gather_int8(model: ModelProto, node_names: set[str]) -> set[str]:
    """Replace each named ``Gather`` over a constant [V, D] table with int8 rows and one fp32 scale per block of
    32 (symmetric, as q8_0): Gather both, multiply, reshape back. Returns the names replaced; a Gather over anything
    but an initializer is left as it is."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    users: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    replaced: set[str] = set()
    for node in list(graph.node):
        if node.name not in node_names or node.input[0] not in inits:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        table = inits[node.input[0]]
        w = numpy_helper.to_array(table).astype(np.float32)
        if axis != 0 or w.ndim != 2:
            continue
        d = w.shape[1]
        q, scale = int8_rows(w)
        p, ids, out = node.name, node.input[1], node.output[0]
        graph.initializer.extend(
            [
                numpy_helper.from_array(q, f"{table.name}.int8"),
                numpy_helper.from_array(scale, f"{table.name}.scale"),
                numpy_helper.from_array(np.array([d], dtype=np.int64), f"{p}.width"),
            ]
        )
        new = gather_int8_nodes(p, f"{table.name}.int8", f"{table.name}.scale", f"{p}.width", ids, out)
        at = list(graph.node).index(node)
        graph.node.remove(node)
        for i, n in enumerate(new):
            graph.node.insert(at + i, n)
        if users.get(table.name, 0) == 1:
            graph.initializer.remove(table)
        replaced.add(p)
    return replaced


def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A [V, D] table as int8 rows with one fp32 scale per block of 32 (symmetric, as q8_0; one block per row when D
    is not a multiple of 32): (q [V, nb, block] int8, scale [V, nb, 1])."""
    v, d = w.shape
    block = BLOCK if d % BLOCK == 0 else d
    wb = w.reshape(v, d // block, block)
    scale = np.abs(wb).max(-1, keepdims=True) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)  # [V, nb, 1]
    q = np.clip(np.rint(wb / scale), -127, 127).astype(np.int8)  # [V, nb, block]
    return q, scale


def gather_int8_nodes(name: str, rows: str, scales: str, width: str, ids: str, out: str) -> list[NodeProto]:
    """The nodes that stand for ``Gather(table, ids)`` over :func:`int8_rows`' ``rows`` and ``scales`` (``width``:
    an int64 [1] initializer holding D): gather both, multiply, reshape back to [..., D]."""
    from onnx import TensorProto, helper

    p = name
    return [
        helper.make_node("Gather", [rows, ids], [f"{p}.q"], name=f"{p}.rows", axis=0),
        helper.make_node("Gather", [scales, ids], [f"{p}.s"], name=f"{p}.scales", axis=0),
        helper.make_node("Cast", [f"{p}.q"], [f"{p}.qf"], name=f"{p}.cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", [f"{p}.qf", f"{p}.s"], [f"{p}.blocks"], name=f"{p}.dequant"),
        helper.make_node("Shape", [ids], [f"{p}.ids_shape"], name=f"{p}.ids_shape"),
        helper.make_node("Concat", [f"{p}.ids_shape", width], [f"{p}.shape"], name=f"{p}.concat", axis=0),
        helper.make_node("Reshape", [f"{p}.blocks", f"{p}.shape"], [out], name=p),
    ]


def save_model(model: ModelProto, path: Path) -> None:
    """One file when it fits protobuf's 2 GB limit, else one external-data file beside it (stale ones removed)."""
    import onnx

    for old in path.parent.glob(path.name + ".data"):
        old.unlink()
    if model.ByteSize() < 1_800_000_000:
        onnx.save(model, str(path))
    else:
        onnx.save(
            model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data"
        )
