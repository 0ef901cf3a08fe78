"""ExecuTorch, Core ML and TFLite exports of tiny Mixtral (3 experts) and Qwen2-MoE (shared expert), each checked
in its runtime (Core ML: structure on Linux, plus the converted torch wrapper against transformers)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from conftest import write_recipe
from moetool.api import export, plan_export
from moetool.export import ExportError
from moetool.io.checkpoint import Checkpoint

EXPERTS = """experts:
  - {{name: a, source: {e1}, positive_prompts: ["def main():"]}}
  - {{name: b, source: {e2}, positive_prompts: ["Permission is hereby granted"]}}
  - {{name: c, source: {e3}, positive_prompts: ["acute bronchitis"]}}
"""
MIXED = "experts=q4_0,router=f32,*=q8_0"


def _merge(tmp, m, name, extra=""):
    from moetool.api import assemble

    text = f"name: {name}\nmethod: mofe\nbase_model: {m['base']}\n{extra}\n" + EXPERTS.format(**m)
    return assemble(write_recipe(tmp / f"{name}.yaml", text), tmp / name)


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("graph-targets")
    q = tiny_models("qwen2")
    return {
        "mixtral": _merge(tmp, tiny_models("llama"), "mx"),
        "qwen2_moe": _merge(tmp, q, "q2", f"shared_expert: {{source: {q['base']}, positive_prompts: ['def']}}"),
    }


def _worst(p):
    return max([*p["max_abs_logit_diff"].values(), p["decode"]["max_abs_logit_diff"]])


# XNNPACK lowering takes about a minute per tiny model here, so one fp32 and one quantized export cover both archs
def test_executorch_fp32_mixtral(models, tmp_path):
    log = io.StringIO()
    man = export(models["mixtral"], tmp_path / "et", target="executorch", quant="f32", console=Console(file=log))
    # each slow stage is announced as it starts (minutes on a 30-layer model), in order, with the elapsed seconds
    lines = log.getvalue().splitlines()
    # (the chunk is quantized, exported and lowered in a process of its own: one announcement for all three)
    stages = ["torch.export and XNNPACK lowering, in a child process", "checking the programs in executorch"]
    at = [next(i for i, line in enumerate(lines) if stage in line and " s  " in line) for stage in stages]
    assert at == sorted(at), log.getvalue()
    assert man["files"].keys() == {"model.pte"} and _worst(man["parity"]) <= 1e-4
    assert man["programs"] == [{"file": "model.pte", "layers": [0, 2]}]
    # the methods' shapes are bounded (ExecuTorch plans and allocates every activation for the largest shape allowed)
    from executorch.runtime import Runtime

    bounds = man["bounds"]
    program = Runtime.get().load_program(str(tmp_path / "et" / "model.pte"))
    assert program.metadata("forward").input_tensor_meta(0).sizes() == (1, bounds["prefill"])
    assert program.metadata("decode").input_tensor_meta(3).sizes()[2] == bounds["context"] - 1
    # every expert runs: XNNPACK cannot select experts in the graph (the reason is recorded for the reader)
    moe = man["moe_kernel"]
    assert moe["kind"] == "dense-masked" and moe["layers"] == 2 and "XNNPACK" in moe["reason"]


def test_executorch_quantized_experts_qwen2_moe(models, tmp_path):
    man = export(models["qwen2_moe"], tmp_path / "et", target="executorch", quant=MIXED)
    # expert gate/up (12) at 4 bits; down_proj's input width 48 is no multiple of XNNPACK's 32-wide groups, so those
    # 6 fall back to 8 bits (noted), with attention (8), the shared experts (6) and the head; routers stay fp32
    assert man["quantized_linears"] == {"int4": 12, "int8": 21}
    assert sum("not a multiple of 32" in n for n in man["notes"]) == 6
    assert 0.5 < man["parity"]["top1_agreement"] <= 1.0


def test_executorch_chunks_streamed(models, tmp_path):
    """One program per decoder layer (--chunk-layers 1), each lowered from its layer alone (two processes at once),
    run in sequence in executorch.runtime (hidden states and each program's own cache passed along) and held to the
    fp32 gate."""
    man = export(models["mixtral"], tmp_path / "et", target="executorch", quant="f32", chunk_layers=1, jobs=2)
    assert man["jobs"] == 2
    assert man["programs"] == [
        {"file": "model_chunk00.pte", "layers": [0, 1]},
        {"file": "model_chunk01.pte", "layers": [1, 2]},
    ]
    assert man["files"].keys() == {"model_chunk00.pte", "model_chunk01.pte"}
    assert _worst(man["parity"]) <= 1e-4 and man["parity"]["decode"]["steps"] == 8
    assert man["moe_kernel"]["layers"] == 2


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_coreml_structure_and_wrapper(models, tmp_path, arch):
    man = export(models[arch], tmp_path / "cm", target="coreml", quant=MIXED)
    s = man["structure"]
    assert s["states"] == ["k_cache", "v_cache"] and s["ios18_or_later"] and s["reloads"]
    assert s["inputs"] == ["input_ids", "position_ids", "mask"] and s["outputs"] == ["logits"]
    comp = man["compressed_weights"]
    assert {k for k, v in comp.items() if v.startswith("int4")} == {
        f"layers.{i}.mlp.experts.{e}.{p}.weight"
        for i in range(2)
        for e in range(3)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert comp["layers.0.mlp.experts.0.gate_proj.weight"] == "int4 block 32"
    assert comp["layers.0.mlp.experts.0.down_proj.weight"] == "int4 block 16"  # input width 48
    assert not any("router" in k for k in comp)  # the router is left uncompressed
    assert s["compressed_weight_ops"]["constexpr_blockwise_shift_scale"] == len(comp)
    assert _worst(man["parity"]) <= 1e-4 and "macOS" in man["parity"]["core_ml_runtime"]
    moe = man["moe_kernel"]
    assert moe["kind"] == "dense-masked" and moe["layers"] == 2 and "compression.py" in moe["reason"]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_tflite_fp32(models, tmp_path, arch):
    man = export(models[arch], tmp_path / "tfl", target="tflite", quant="f32")
    assert _worst(man["parity"]) <= 1e-4 and man["parity"]["decode"]["steps"] == 8
    moe = man["moe_kernel"]
    assert moe["kind"] == "dense-masked" and moe["layers"] == 2 and "torch.cond" in moe["reason"]


def test_tflite_chunks_streamed(models, tmp_path):
    """One model per decoder layer (--chunk-layers 1), each converted from its layer alone in its own process, run
    in sequence in the LiteRT interpreter (hidden states and each model's own cache passed along), held to the fp32
    gate."""
    man = export(models["mixtral"], tmp_path / "tfl", target="tflite", quant="f32", chunk_layers=1)
    assert man["chunks"] == [
        {"file": "model_chunk00.tflite", "layers": [0, 1]},
        {"file": "model_chunk01.tflite", "layers": [1, 2]},
    ]
    assert set(man["files"]) == {"model_chunk00.tflite", "model_chunk01.tflite"}
    assert _worst(man["parity"]) <= 1e-4 and man["parity"]["decode"]["steps"] == 8
    assert man["moe_kernel"]["layers"] == 2


# the dtype of each FULLY_CONNECTED op's weight in a .tflite, read in litert-torch's interpreter: {rows: [dtypes]}
_FC_DTYPES = """
import json, sys
from ai_edge_litert.interpreter import Interpreter
it = Interpreter(model_path=sys.argv[1])
ts = {d["index"]: d for d in it.get_tensor_details()}
out = {}
for op in it._get_ops_details():
    if op["op_name"] == "FULLY_CONNECTED":
        w = ts[op["inputs"][1]]
        out.setdefault(str(w["shape"][0]), []).append(w["dtype"].__name__)
print(json.dumps(out))
"""


def _fc_dtypes(path):
    import json
    import subprocess

    from moetool.export.tflite.runner import litert_python

    proc = subprocess.run([litert_python(), "-c", _FC_DTYPES, str(path)], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tflite_mixed_precision_by_role(models, tmp_path):
    man = export(models["mixtral"], tmp_path / "tfl", target="tflite", quant=MIXED)
    # the head is quantized as planned (its op is named after the logits it returns, not after its module)
    vocab = str(Checkpoint(models["mixtral"]).config["vocab_size"])
    assert set(_fc_dtypes(tmp_path / "tfl" / "model.tflite")[vocab]) == {"int8"}
    # down_proj's input width 48 rules out 32-blocks, so the experts' int4 is per channel (noted)
    assert man["quantized_roles"] == {"experts": "int4 (per channel)", "attention": "int8", "output": "int8"}
    assert any("per channel, not blockwise" in n for n in man["tflite_notes"])
    assert any("embeddings planned int8 but kept fp32" in n for n in man["tflite_notes"])
    with pytest.raises(ExportError, match="per role"):
        plan_export(models["mixtral"], tmp_path / "x", target="tflite", quant="layers.0.*=q4_0,*=q8_0")


def test_coreml_chunks_streamed(models, tmp_path):
    """One package per decoder layer (--chunk-layers 1): each converted from its layer alone (two processes at
    once), hidden states passed from one to the next, the chain of wrappers checked against transformers as one
    model."""
    man = export(models["mixtral"], tmp_path / "cm", target="coreml", quant=MIXED, chunk_layers=1, jobs=2)
    assert man["jobs"] == 2
    chunks = man["chunks"]
    assert [c["file"] for c in chunks] == ["model_chunk00.mlpackage", "model_chunk01.mlpackage"]
    assert [c["layers"] for c in chunks] == [[0, 1], [1, 2]] and man["structure"] is None
    first, last = chunks[0]["structure"], chunks[1]["structure"]
    assert first["inputs"] == ["input_ids", "position_ids", "mask"] and first["outputs"] == ["next_hidden_states"]
    assert last["inputs"] == ["hidden_states", "position_ids", "mask"] and last["outputs"] == ["logits"]
    assert all(c["structure"]["states"] == ["k_cache", "v_cache"] and c["structure"]["reloads"] for c in chunks)
    # every expert weight compressed, each in the package of its own layer
    comp = man["compressed_weights"]
    assert sum(v.startswith("int4") for v in comp.values()) == 18
    assert sum(c["structure"]["compressed_weight_ops"]["constexpr_blockwise_shift_scale"] for c in chunks) == len(comp)
    assert _worst(man["parity"]) <= 1e-4 and man["parity"]["decode"]["steps"] == 8
    assert {p.split("/")[0] for p in man["files"]} == {c["file"] for c in chunks}
