"""ExecuTorch, Core ML and TFLite exports of tiny Mixtral (3 experts) and Qwen2-MoE (shared expert), each checked
in its runtime (Core ML: structure on Linux, plus the converted torch wrapper against transformers)."""

from __future__ import annotations

import pytest

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


# XNNPACK lowering takes about a minute per tiny model here: the fp32 runner program is test_executorch_runner.py's,
# a quantized one and a chain of programs are here
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
    assert s["states"] == ["keyCache", "valueCache"] and s["ios18_or_later"] and s["reloads"] and s["mil_loads"]
    assert s["inputs"] == ["inputIds", "causalMask"] and s["outputs"] == ["logits"]
    assert s["io"]["inputIds"] == "int32 [1, 1..128]" and s["io"]["causalMask"] == "float16 [1, 1, 1..128, 1..128]"
    assert s["io"]["keyCache"] == "float16 [2, 1, 2, 128, 8]" and man["join"] is None
    assert s["metadata"]["co.huggingface.exporters.task"] == "text-generation"
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


# loads a .litertlm in LiteRT-LM (litert-lm-api, in litert-torch's venv) and prints its tokenizer's special ids
_LITERT_LM = """
import json, sys, tempfile, litert_lm
with tempfile.TemporaryDirectory() as cache:
    e = litert_lm.Engine(sys.argv[1], backend=litert_lm.Backend.CPU(thread_count=2), cache_dir=cache,
                         activation_data_type=litert_lm.ActivationDataType.FLOAT32)
    print(json.dumps({"bos": e.bos_token_id, "eos": e.eos_token_ids, "tokens": e.tokenize("hello world")}))
"""


def _litert_lm_python():
    """litert-torch's interpreter with litert-lm-api beside it, else the test is skipped (saying which is missing)."""
    from moetool.export.tflite.bundle import litert_lm_missing
    from moetool.export.tflite.runner import litert_python
    from moetool.extras import MissingExtraError

    try:
        py = litert_python()
    except MissingExtraError as exc:
        pytest.skip(f"no litert-torch venv: {exc}")
    if litert_lm_missing():
        pytest.skip(f"{', '.join(litert_lm_missing())} not installed beside litert-torch (setup.sh --tflite)")
    return py


def _litert_lm(path):
    """What LiteRT-LM reads from the bundle at ``path``."""
    import json
    import subprocess

    proc = subprocess.run(
        [_litert_lm_python(), "-c", _LITERT_LM, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_tflite_fp32(models, tmp_path, arch):
    _litert_lm_python()
    man = export(models[arch], tmp_path / "tfl", target="tflite", quant="f32")
    assert _worst(man["parity"]) <= 1e-4 and man["parity"]["decode"]["steps"] == 8
    moe = man["moe_kernel"]
    assert moe["kind"] == "dense-masked" and moe["layers"] == 2 and "torch.cond" in moe["reason"]
    # one model: it is in LiteRT-LM's layout and bundled with the tokenizer; LiteRT-LM generates from the bundle the
    # text transformers does at float32 (the export raises otherwise; random weights make odd text, compared as text
    # whose broken UTF-8 both tokenizers decode to U+FFFD, and as tokens after re-tokenising both)
    assert man["signatures"].keys() == {"prefill_120", "decode"}
    assert set(man["files"]) == {"model.tflite", "model.litertlm"}
    assert man["litertlm"] | {"max_num_tokens": 128, "start_ids": [1], "stop_ids": [2]} == man["litertlm"]
    run = man["runner"]
    assert run["name"] == "LiteRT-LM (litert-lm-api 0.18.1)" and run["file"] == "model.litertlm" and run["judged"]
    assert run["same_text"] and run["text"] == run["reference_text"] and run["new_tokens"] == 16
    assert run["same_prefix_tokens"] == run["reference_tokens"] > 0
    assert run["prompt_tokens"] == run["reference_prompt_tokens"]  # the start token prepended once, by the runtime
    assert run["prefill_tok_s"] > 0 and run["decode_tok_s"] > 0 and run["ttft_s"] > 0
    # the engine's weight cache went to a folder of its own, not beside the bundle
    assert sorted(p.name for p in (tmp_path / "tfl").iterdir()) == ["manifest.json", "model.litertlm", "model.tflite"]
    seen = _litert_lm(tmp_path / "tfl" / "model.litertlm")
    assert seen["bos"] == 1 and seen["eos"] == [[2]] and seen["tokens"][0] != 1  # its tokenizer adds no BOS itself


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
    # LiteRT-LM runs one decoder model: no bundle, and the manifest says why
    assert not (tmp_path / "tfl" / "model.litertlm").exists() and man["litertlm"]["file"] is None
    assert "2 chunks" in man["litertlm"]["why"] and "one decoder model" in man["litertlm"]["why"]
    assert man["runner"] == man["litertlm"]["why"]


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
    # the quantized model is bundled too; LiteRT-LM's text is reported against transformers', not judged
    run = man["runner"]
    assert "model.litertlm" in man["files"] and not run["judged"] and run["new_tokens"] > 0
    assert {"text", "reference_text", "same_text", "same_prefix_tokens", "prefill_tok_s", "ttft_s"} <= run.keys()
    with pytest.raises(ExportError, match="per role"):
        plan_export(models["mixtral"], tmp_path / "x", target="tflite", quant="layers.0.*=q4_0,*=q8_0")


def test_coreml_chunks_streamed(models, tmp_path):
    """One chunk per decoder layer (--chunk-layers 1): each converted from its layer alone (two processes at once),
    declaring the model-wide states, then joined into ONE package whose program runs them in turn (hidden states
    passed inside it); the chain of wrappers checked against transformers as one model."""
    import coremltools as ct

    from moetool.export.coreml.join import weights_file

    out = tmp_path / "cm"
    man = export(models["mixtral"], out, target="coreml", quant=MIXED, chunk_layers=1, jobs=2)
    assert man["jobs"] == 2
    chunks = man["chunks"]
    assert [c["layers"] for c in chunks] == [[0, 1], [1, 2]]
    first, last = chunks[0]["structure"], chunks[1]["structure"]
    assert first["inputs"] == ["inputIds", "causalMask"] and first["outputs"] == ["nextHiddenStates"]
    assert last["inputs"] == ["hiddenStates", "causalMask"] and last["outputs"] == ["logits"]
    assert all(c["structure"]["states"] == ["keyCache", "valueCache"] for c in chunks)
    # one package, the chunks gone; read back here as an app's loader reads it
    assert {p.split("/")[0] for p in man["files"]} == {"model.mlpackage"} and man["file"] == "model.mlpackage"
    spec = ct.utils.load_spec(str(out / "model.mlpackage"))
    assert spec.WhichOneof("Type") == "mlProgram" and list(spec.mlProgram.functions) == ["main"]
    assert [f.name for f in spec.description.state] == ["keyCache", "valueCache"]
    assert [f.name for f in spec.description.input] == ["inputIds", "causalMask"]
    assert [f.name for f in spec.description.output] == ["logits"]
    assert spec.description.state[0].type.stateType.arrayType.shape == [2, 1, 2, 128, 8]  # both layers' slots
    meta = spec.description.metadata.userDefined
    assert meta["co.huggingface.exporters.framework"] == "pytorch" and "MixtralForCausalLM" in meta.values()
    # the weights are the chunks': every blob of both, every reference landing on one, every op type-checked
    s, join = man["structure"], man["join"]
    assert join["chunks"] == 2 and join["blobs"] == sum(join["blobs_per_chunk"]) == s["weight_blobs"]
    assert all(n > 0 for n in join["blobs_per_chunk"]) and s["blobs_match_chunks"] and s["weight_references_land"]
    assert (
        s["mil_loads"] and s["reloads"] and "no weight is loaded" in join["memory"] and join["process_peak_bytes"] > 0
    )
    assert join["weight_bytes"] == weights_file(out / "model.mlpackage").stat().st_size
    assert s["ops"]["slice_update"] == 4 and s["ops"]["coreml_update_state"] == 4  # k and v of each layer, once
    # every expert weight compressed, each in the chunk of its own layer, all of them in the package
    comp = man["compressed_weights"]
    assert sum(v.startswith("int4") for v in comp.values()) == 18
    assert sum(c["structure"]["compressed_weight_ops"]["constexpr_blockwise_shift_scale"] for c in chunks) == len(comp)
    assert s["compressed_weight_ops"]["constexpr_blockwise_shift_scale"] == len(comp)
    assert _worst(man["parity"]) <= 1e-4 and man["parity"]["decode"]["steps"] == 8
    # bit for bit the weights of the same model converted whole: the join copies blobs, it never re-encodes one
    whole = tmp_path / "whole"
    export(models["mixtral"], whole, target="coreml", quant=MIXED, verify=False)
    assert sorted(_blobs(weights_file(out / "model.mlpackage"))) == sorted(
        _blobs(weights_file(whole / "model.mlpackage"))
    )


def _blobs(path):
    """(dtype, size, digest) of every blob in a Core ML weight.bin (blob storage v2)."""
    import hashlib
    import struct

    data = path.read_bytes()
    count = struct.unpack_from("<I", data)[0]
    found, pos = [], 64
    for _ in range(count):
        sentinel, dtype, size, offset = struct.unpack_from("<IIQQ", data, pos)
        assert sentinel == 0xDEADBEEF
        found.append((dtype, size, hashlib.sha1(data[offset : offset + size]).hexdigest()))
        pos = (offset + size + 63) // 64 * 64
    return found
