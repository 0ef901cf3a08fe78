"""The Core ML package as an app reads it: a converted chunk's program (:func:`structure`), the joined package read
back and checked (:func:`package_structure`, :func:`check_package`: the spec, the states and names the runners use,
the program loaded into coremltools' MIL, the weight blobs), and the metadata huggingface/exporters writes
(:func:`hf_metadata`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetool.export.base import ExportError
from moetool.export.coreml.chunks import MODEL_FILE
from moetool.export.coreml.stateful import STATES
from moetool.io.jsontypes import JsonObject

if TYPE_CHECKING:
    from coremltools.models import MLModel

    from moetool.export.coreml.join import Joined
    from moetool.export.graph.common import GraphPlan

__all__ = ["check_package", "description", "hf_metadata", "package_structure", "structure"]


def structure(ml: MLModel, path: Path) -> JsonObject:
    """A converted chunk's program as the worker saved it: spec version, states, names, op histogram."""
    import coremltools as ct

    spec = ml.get_spec()
    ops = Counter(op.op_type for op in ml._mil_program.functions["main"].operations)
    reloaded = ct.models.MLModel(str(path), skip_model_load=True)
    return {
        "spec_version": spec.specificationVersion,
        "ios18_or_later": spec.specificationVersion >= 9,
        "states": [s.name for s in spec.description.state],
        "inputs": [i.name for i in spec.description.input],
        "outputs": [o.name for o in spec.description.output],
        "reloads": reloaded.get_spec().specificationVersion == spec.specificationVersion,
        "ops": {**dict(ops.most_common())},
        "compressed_weight_ops": {k: v for k, v in ops.items() if k.startswith("constexpr_")},
    }


def _feature(f: Any) -> str:
    """A spec feature as ``dtype [dims]``, a flexible dimension as ``lo..hi``."""
    from coremltools.proto import FeatureTypes_pb2

    kind = f.type.WhichOneof("Type")
    arr = f.type.stateType.arrayType if kind == "stateType" else f.type.multiArrayType
    dtype = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(arr.dataType).lower()
    ranges = arr.shapeRange.sizeRanges
    dims = [
        f"{r.lowerBound}..{r.upperBound}" if r.lowerBound != r.upperBound else str(r.lowerBound) for r in ranges
    ] or [str(d) for d in arr.shape]
    return f"{dtype} [{', '.join(dims)}]" if dims else f"{dtype} (shape set at run time)"  # e.g. the outputs


def package_structure(path: Path, blobs: int | None = None) -> JsonObject:
    """The package written, read back as an app's loader would read it: the spec (``ct.utils.load_spec`` and
    ``MLModel(skip_model_load=True)``, which must agree), its states, inputs and outputs with their types, the
    program loaded into coremltools' MIL (its loader type-checks every op) with its op histogram, and its weight
    blobs: the count in the blob file's header, the program's references to it, whether each lands on a blob, and
    (``blobs``) whether the count is the chunks' sum. Memory: the package's weights, loaded by the MIL loader."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    from moetool.export.coreml.join import blob_count, blob_offsets, blobs_land, weights_file

    spec = ct.utils.load_spec(str(path))
    same = ct.models.MLModel(str(path), skip_model_load=True).get_spec() == spec
    wfile = weights_file(path)
    prog = milproto_load(spec, spec.specificationVersion, str(wfile.parent))
    ops = Counter(op.op_type for op in prog.functions["main"].operations)
    del prog
    offsets = blob_offsets(spec.mlProgram)
    count = blob_count(wfile) if wfile.is_file() else 0
    meta = spec.description.metadata
    return {
        "spec_version": spec.specificationVersion,
        "ios18_or_later": spec.specificationVersion >= 9,
        "type": str(spec.WhichOneof("Type")),
        "functions": list(spec.mlProgram.functions.keys()),
        "states": [s.name for s in spec.description.state],
        "inputs": [i.name for i in spec.description.input],
        "outputs": [o.name for o in spec.description.output],
        "io": {
            f.name: _feature(f) for f in [*spec.description.input, *spec.description.output, *spec.description.state]
        },
        "reloads": same,
        "mil_loads": True,  # milproto_load raised otherwise
        "ops": {**dict(ops.most_common())},
        "compressed_weight_ops": {k: v for k, v in ops.items() if k.startswith("constexpr_")},
        "weight_blobs": count,
        "weight_references": len(offsets),
        "weight_references_land": blobs_land(wfile, offsets) if offsets else True,
        "blobs_match_chunks": None if blobs is None else count == blobs,
        "metadata": {k: meta.userDefined[k] for k in sorted(meta.userDefined) if k.startswith("co.huggingface")},
    }


def hf_metadata(plan: GraphPlan, precision: str) -> dict[str, str]:
    """The user-defined metadata huggingface/exporters writes (``co.huggingface.exporters.*``): swift-transformers
    reads ``name`` as the Hub repo whose tokenizer and config it fetches, so it is the model's name here (set it to
    the repo id when the package is pushed elsewhere)."""
    archs = plan.config.get("architectures") or [str(plan.config.get("model_type", ""))]
    return {
        "co.huggingface.exporters.name": plan.name,
        "co.huggingface.exporters.task": "text-generation",
        "co.huggingface.exporters.architecture": str(archs[0]),
        "co.huggingface.exporters.framework": "pytorch",
        "co.huggingface.exporters.precision": precision,
    }


def description(plan: GraphPlan) -> str:
    return f"{plan.name}: stateful decoder (moetool), weights {plan.quant.label}"


def check_package(info: JsonObject, joined: Joined | None) -> None:
    """Refuse a package whose structure is not the one an app expects.

    Raises:
        ExportError: not one iOS 18 ML Program with ``inputIds``/``causalMask`` in, ``logits`` out and the two
            states; or its weight blobs are not the chunks' (count, or a reference that lands off a blob).
    """
    want = (["inputIds", "causalMask"], ["logits"], list(STATES), ["main"])
    got = (info["inputs"], info["outputs"], info["states"], info["functions"])
    if got != want or not info["ios18_or_later"] or not info["reloads"]:
        raise ExportError(f"{MODEL_FILE}: expected inputs, outputs, states, functions {want}, found {got}")
    if not info["weight_references_land"] or info["blobs_match_chunks"] is False:
        n = None if joined is None else joined.blobs
        raise ExportError(f"{MODEL_FILE}: {info['weight_blobs']} weight blobs where the chunks had {n}")
