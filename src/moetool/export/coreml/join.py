"""Chunks of a stateful ML Program joined into ONE single-function ``.mlpackage``, without loading a weight.

Why not coremltools' own ways: ``ct.utils.make_pipeline`` accepts stateful models but copies only their inputs and
outputs (a pipeline has no states, so the app could not make one ``MLState``); a multifunction package
(``save_multifunction``) keeps the chunks as functions the app loads and calls in turn, and loads every weight while
saving; converting all the layers at once holds the model several times over. So the join works on the protobuf:

- **Programs.** Every chunk's ``main`` block is appended to one ``main`` function, every SSA name prefixed with its
  chunk (``c1__…``). Chunk i+1's hidden-state input is bound to chunk i's output var; an input or state another chunk
  already declared (``causalMask``, ``keyCache``, ``valueCache``) must have the same type and is taken once; the last
  chunk's outputs keep their names (``logits``). Op order is kept, so a chunk reads the states its predecessors wrote:
  each chunk declares the model-wide states and writes only its own layers' slots
  (:class:`~moetool.export.coreml.stateful.StatefulChunk`).
- **Weights.** The chunks' ``weight.bin`` files (MIL blob storage v2: a 64-byte header ``count, version``, then per
  blob a 64-byte metadata record ``0xDEADBEEF, dtype, size, offset`` and the data, 64-aligned; coremltools'
  ``mlmodel/src/MILBlob/Blob/StorageFormat.hpp``) are concatenated raw, in 16 MiB pieces, each chunk at an aligned
  base: its metadata's data offsets and its program's ``blobFileValue`` offsets move by the same delta. Nothing is
  decoded, so a 4-bit blob stays bit-identical.

Memory: the chunks' programs (protobuf, kilobytes to a few megabytes) and one copy buffer, whatever the model's size.
Disk: each chunk package is removed as soon as its weights are copied (``consume``), so the chunks and the joined
package overlap by one chunk at most.
"""

from __future__ import annotations

import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, cast

from moetool.export.base import ExportError
from moetool.io.jsontypes import JsonObject

if TYPE_CHECKING:
    from coremltools.proto import MIL_pb2, Model_pb2

__all__ = [
    "CHAIN",
    "COPY_BUFFER",
    "Joined",
    "blob_count",
    "blob_offsets",
    "blobs_land",
    "join_packages",
    "weights_file",
]

# the hidden states between chunks: a chunk's input, and its predecessor's output (two names, since one program may
# not take and return the same name)
CHAIN = ("hiddenStates", "nextHiddenStates")
COPY_BUFFER = 16 << 20
_ALIGN = 64  # blob storage aligns the header, each metadata record and each blob's data to 64 bytes
_SENTINEL = 0xDEADBEEF
_VERSION = 2


@dataclass(frozen=True)
class Joined:
    """What a join wrote: ``blobs`` weight blobs (the chunks' sum) in ``weight_bytes``, from ``chunk_blobs`` per
    chunk; the programs it read (``spec_bytes``, what its memory is bounded by) and how long it took."""

    path: Path
    chunk_blobs: list[int]
    blobs: int
    weight_bytes: int
    spec_bytes: int
    seconds: float

    def record(self) -> JsonObject:
        """The manifest's ``join`` entry."""
        memory = (
            f"the chunks' programs ({self.spec_bytes} bytes of protobuf) and a {COPY_BUFFER >> 20} MiB copy buffer: "
            "no weight is loaded, whatever the model's size"
        )
        return {
            "chunks": len(self.chunk_blobs),
            "blobs_per_chunk": [*self.chunk_blobs],
            "blobs": self.blobs,
            "weight_bytes": self.weight_bytes,
            "seconds": round(self.seconds, 2),
            "memory": memory,
        }


def weights_file(package: Path) -> Path:
    """The blob file of ``package`` (it may not exist: a program without large constants)."""
    return package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _header(f: BinaryIO, where: Path) -> int:
    """The blob count of an open blob file, after checking its version."""
    count, version = struct.unpack("<II", f.read(8))
    if version != _VERSION:
        raise ExportError(f"{where}: blob storage version {version}; the join reads version {_VERSION}")
    return int(count)


def _append(src: Path, out: BinaryIO) -> tuple[int, int]:
    """``src``'s blobs appended to the open file ``out`` at the next aligned offset; returns (delta, count): each of
    its offsets moves by delta. Its metadata's data offsets are rewritten in place in ``out``."""
    base = _aligned(out.tell())
    out.write(b"\0" * (base - out.tell()))
    delta = base - _ALIGN  # the source's blobs start right after its own header
    with src.open("rb") as f:
        count = _header(f, src)
        f.seek(_ALIGN)
        shutil.copyfileobj(f, out, COPY_BUFFER)
        end = out.tell()
        pos = _ALIGN
        for _ in range(count):
            f.seek(pos)
            sentinel, _dtype, size, offset = struct.unpack("<IIQQ", f.read(24))
            if sentinel != _SENTINEL:
                raise ExportError(f"{src}: no blob metadata at offset {pos}")
            out.seek(pos + delta + 16)
            out.write(struct.pack("<Q", offset + delta))
            pos = _aligned(offset + size)
        out.seek(end)
    return delta, count


def _walk_values(msg: object, fn: Callable[[MIL_pb2.Value], None]) -> None:
    """``fn`` on every MIL ``Value`` reachable from ``msg`` (protobuf's upb containers have no ``__iter__`` attribute
    to test for, so repeated fields are told apart by ``__len__``)."""
    from coremltools.proto import MIL_pb2

    if isinstance(msg, MIL_pb2.Value):
        fn(msg)
    if hasattr(msg, "ListFields"):
        for _, val in msg.ListFields():
            _walk_values(val, fn)
    elif hasattr(msg, "values") and callable(msg.values) and not hasattr(msg, "append"):  # a map
        for v in msg.values():
            _walk_values(v, fn)
    elif hasattr(msg, "__len__") and not isinstance(msg, str | bytes):  # a repeated field: a sequence
        for v in cast("Sequence[object]", msg):
            _walk_values(v, fn)


def blob_offsets(msg: object) -> list[int]:
    """The weight.bin offset of every ``blobFileValue`` in a program (a spec or a block)."""
    found: list[int] = []
    _walk_values(msg, lambda v: found.append(int(v.blobFileValue.offset)) if _is_blob(v) else None)
    return found


def _is_blob(v: MIL_pb2.Value) -> bool:
    return bool(v.WhichOneof("value") == "blobFileValue")


def _rename_block(block: MIL_pb2.Block, rn: Callable[[str], str]) -> None:
    """Every SSA name in a MIL block, nested blocks included, through ``rn``; op names too, so they stay unique."""
    for nv in block.inputs:
        nv.name = rn(nv.name)
    for i, o in enumerate(block.outputs):
        block.outputs[i] = rn(o)
    for op in block.operations:
        for arg in op.inputs.values():
            for b in arg.arguments:
                if b.WhichOneof("binding") == "name":
                    b.name = rn(b.name)
        for o in op.outputs:
            o.name = rn(o.name)
        if "name" in op.attributes:
            s = op.attributes["name"].immediateValue.tensor.strings.values
            if len(s):
                s[0] = rn(s[0])
        for sub in op.blocks:
            _rename_block(sub, rn)


def _specs(chunks: list[Path]) -> tuple[list[Model_pb2.Model], str, int]:
    """Each chunk's spec (the program only), their opset and the bytes read."""
    import coremltools as ct

    specs = [ct.utils.load_spec(str(p)) for p in chunks]
    for p, s in zip(chunks, specs, strict=True):
        if s.WhichOneof("Type") != "mlProgram" or len(s.description.functions) or "main" not in s.mlProgram.functions:
            raise ExportError(f"{p.name}: the join takes single-function ML Programs")
    opsets = {s.mlProgram.functions["main"].opset for s in specs}
    if len(opsets) != 1:
        raise ExportError(f"the chunks use different opsets: {sorted(opsets)}")
    spec_bytes = sum((p / "Data" / "com.apple.CoreML" / "model.mlmodel").stat().st_size for p in chunks)
    return specs, opsets.pop(), spec_bytes


def _bind(
    i: int,
    spec: Model_pb2.Model,
    fn: MIL_pb2.Function,
    declared: dict[str, MIL_pb2.NamedValueType],
    features: tuple[list[Model_pb2.FeatureDescription], list[Model_pb2.FeatureDescription]],
    chained: str,
    previous: str | None,
) -> dict[str, str]:
    """Chunk ``i``'s function inputs and states bound to the joined function's vars: ``chained`` to ``previous``
    (the output of the chunk before), one already ``declared`` to itself (its type must be the same), a new one added
    to ``fn`` and to the model's input or state ``features``."""
    described = {f.name: f for f in [*spec.description.input, *spec.description.state]}
    bound: dict[str, str] = {}
    for nv in spec.mlProgram.functions["main"].inputs:
        if nv.name == chained:
            if previous is None:
                raise ExportError(f"chunk {i} takes {chained!r} but no chunk before it returns it")
            bound[nv.name] = previous
            continue
        bound[nv.name] = nv.name
        if nv.name in declared:
            if declared[nv.name].type != nv.type:
                raise ExportError(f"chunk {i} declares {nv.name!r} with another type than the chunks before")
            continue
        declared[nv.name] = fn.inputs.add()
        declared[nv.name].CopyFrom(nv)
        f = described[nv.name]
        features[1 if f.type.WhichOneof("Type") == "stateType" else 0].append(f)
    return bound


def _program(specs: list[Model_pb2.Model], opset: str, deltas: list[int], chain: tuple[str, str]) -> Model_pb2.Model:
    """The joined spec: one ``main`` function of every chunk's ops (see the module docstring)."""
    from coremltools.proto import MIL_pb2, Model_pb2

    out = Model_pb2.Model()
    out.specificationVersion = max(s.specificationVersion for s in specs)
    out.mlProgram.version = specs[0].mlProgram.version
    for k, v in specs[0].mlProgram.attributes.items():
        out.mlProgram.attributes[k].CopyFrom(v)
    fn = out.mlProgram.functions["main"]
    fn.opset = opset
    blk = fn.block_specializations[opset]
    declared: dict[str, MIL_pb2.NamedValueType] = {}  # function input or state → its NamedValueType
    inputs: list[Model_pb2.FeatureDescription] = []  # model-level descriptions, in first-declared order
    states: list[Model_pb2.FeatureDescription] = []
    previous: str | None = None  # the renamed output var of the chunk before
    for i, s in enumerate(specs):
        block = MIL_pb2.Block()
        block.CopyFrom(s.mlProgram.functions["main"].block_specializations[opset])
        last = i == len(specs) - 1
        bound = _bind(i, s, fn, declared, (inputs, states), chain[0], previous)
        outs = set(block.outputs)

        def rn(name: str, i: int = i, last: bool = last, bound: dict[str, str] = bound, outs: set[str] = outs) -> str:
            if name in bound:
                return bound[name]
            if last and name in outs:
                return name  # the model's outputs keep their names
            return f"c{i}__{name}"

        _rename_block(block, rn)
        delta = deltas[i]
        if delta:

            def moved(v: MIL_pb2.Value, delta: int = delta) -> None:
                if _is_blob(v):
                    v.blobFileValue.offset += delta

            _walk_values(block, moved)
        blk.operations.extend(block.operations)
        if last:
            blk.outputs.extend(block.outputs)
            for o in s.description.output:
                out.description.output.add().CopyFrom(o)
        elif [o.name for o in s.description.output] != [chain[1]]:
            raise ExportError(f"chunk {i} returns {[o.name for o in s.description.output]}, not [{chain[1]!r}]")
        else:
            previous = rn(chain[1])
    for f in inputs:
        out.description.input.add().CopyFrom(f)
    for f in states:
        out.description.state.add().CopyFrom(f)
    out.description.metadata.CopyFrom(specs[0].description.metadata)
    return out


def join_packages(
    chunks: list[Path],
    out: Path,
    *,
    metadata: dict[str, str] | None = None,
    description: str | None = None,
    chain: tuple[str, str] = CHAIN,
    consume: bool = False,
) -> Joined:
    """``chunks`` (converted in order, each a stateful single-function ML Program) joined into the package ``out``,
    with ``metadata`` added to its user-defined metadata and ``description`` as its short description. ``consume``:
    remove each chunk package once its weights are copied.

    Raises:
        ExportError: a chunk is no single-function ML Program, the opsets differ, a shared input or state differs in
            type, the chain's names are not where they should be, or a blob file is not blob storage version 2.
    """
    from coremltools.models.utils import _create_mlpackage

    started = time.perf_counter()
    specs, opset, spec_bytes = _specs(chunks)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.join"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "weights").mkdir(parents=True)
    blob = staging / "weight.bin"
    deltas: list[int] = []
    counts: list[int] = []
    try:
        with blob.open("wb") as f:
            f.write(b"\0" * _ALIGN)  # the header, once the count is known
            for p in chunks:
                src = weights_file(p)
                delta, count = _append(src, f) if src.is_file() else (0, 0)
                deltas.append(delta)
                counts.append(count)
                if consume:
                    shutil.rmtree(p)
            f.seek(0)
            f.write(struct.pack("<II", sum(counts), _VERSION))
        spec = _program(specs, opset, deltas, chain)
        if description:
            spec.description.metadata.shortDescription = description
        for k, v in (metadata or {}).items():
            spec.description.metadata.userDefined[k] = v
        shutil.rmtree(out, ignore_errors=True)
        # coremltools' own package writer (what MLModel.save uses), given an empty weights folder: the blob file is
        # moved in afterwards, a rename, where handing it over would copy it
        _create_mlpackage(spec, weights_dir=str(staging / "weights"), package_path=str(out))
        target = weights_file(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(blob, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Joined(out, counts, sum(counts), target.stat().st_size, spec_bytes, time.perf_counter() - started)


def blob_count(path: Path) -> int:
    """The count in a blob file's header."""
    with path.open("rb") as f:
        return _header(f, path)


def blobs_land(path: Path, offsets: Iterable[int]) -> bool:
    """Whether every offset of ``offsets`` is a blob's metadata record in the blob file ``path`` (what a reference
    shifted by a wrong delta would miss)."""
    with path.open("rb") as f:
        for offset in offsets:
            f.seek(offset)
            head = f.read(4)
            if len(head) < 4 or struct.unpack("<I", head)[0] != _SENTINEL:
                return False
    return True
