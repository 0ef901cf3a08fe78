"""The default ExecuTorch export is one program that ExecuTorch's own LLM runner (TextLLMRunner, the runner of its
demo apps) loads unchanged: ``forward(tokens, input_pos)`` with the KV cache inside, the metadata methods it reads,
the weights in ``model.ptd`` and the tokenizer beside; checked in executorch.runtime and by the runner generating."""

from __future__ import annotations

import json

import pytest
from streamed_fixtures import deep_moe as deep_moe_at
from streamed_fixtures import live_tensor_bytes

from conftest import write_recipe
from moetool.api import assemble, export, plan_export
from moetool.compute.upcast import layer_bytes
from moetool.export import ExportError
from moetool.export.executorch import lowering, runner_check, runner_export
from moetool.io.checkpoint import Checkpoint

QUANT = "experts=q4_0,router=f32,*=q8_0"


@pytest.fixture(scope="module")
def mixtral(tiny_models, tmp_path_factory):
    m = tiny_models("llama")
    tmp = tmp_path_factory.mktemp("et-runner")
    text = f"name: mx\nmethod: mofe\nbase_model: {m['base']}\nexperts:\n" + "".join(
        f"  - {{name: {n}, source: {m[e]}, positive_prompts: ['{p}']}}\n"
        for n, e, p in (("a", "e1", "def main():"), ("b", "e2", "Permission"), ("c", "e3", "acute bronchitis"))
    )
    return assemble(write_recipe(tmp / "mx.yaml", text), tmp / "mx")


@pytest.fixture(scope="module")
def program(mixtral, tmp_path_factory):
    out = tmp_path_factory.mktemp("et-runner-out") / "et"
    return out, export(mixtral, out, target="executorch", quant="f32")


def test_the_runner_loads_the_program_and_generates_transformers_tokens(program):
    out, man = program
    assert {"model.pte", "model.ptd", "tokenizer.json", "tokenizer_config.json"} <= set(man["files"])
    runner = man["runner"]
    # greedy: the runner's 16 tokens are transformers' (an fp32 program is held to it; the export fails otherwise)
    assert runner["tokens_equal"] and runner["same_leading_tokens"] == runner["new_tokens"] == 16
    assert runner["prompt_tokens"] == runner["reference_prompt_tokens"]
    # its own speed figures: a rate wherever its span (whole milliseconds) is not 0, and none where it is
    for stage in ("prefill", "decode"):
        span, rate = runner[f"{stage}_ms"], runner[f"{stage}_tok_s"]
        assert span >= 0 and (rate > 0 if span > 0 else rate is None), (stage, span, rate)
    # the same program in executorch.runtime, prefill at two lengths and cached decode, within the fp32 gate
    parity = man["parity"]
    assert max([*parity["max_abs_logit_diff"].values(), parity["decode"]["max_abs_logit_diff"]]) <= 1e-4
    assert json.loads((out / "manifest.json").read_text())["runner"] == runner


def test_the_program_has_the_runners_contract(program):
    """What TextLLMRunner reads: a method ``forward`` of two inputs (tokens [1, T] of dynamic T, the start position
    [1]), its metadata methods, the weights outside the program (without the .ptd it cannot run)."""
    from executorch.runtime import Runtime

    out, man = program
    prog = Runtime.get().load_program(str(out / "model.pte"), data_path=str(out / "model.ptd"))
    meta = prog.metadata("forward")
    assert meta.num_inputs() == 2 and meta.input_tensor_meta(1).sizes() == (1,)
    assert meta.input_tensor_meta(0).sizes() == (1, man["bounds"]["prefill"])  # its upper bound
    read = {m: prog.load_method(m).execute([])[0] for m in ("get_max_seq_len", "get_max_context_len", "use_kv_cache")}
    assert read == {"get_max_seq_len": 128, "get_max_context_len": 128, "use_kv_cache": True}
    assert prog.load_method("get_eos_ids").execute([]) == [2]
    # the weights live in model.ptd: the program alone cannot load its method
    with pytest.raises(RuntimeError):
        Runtime.get().load_program(str(out / "model.pte")).load_method("forward")
    moe = man["moe_kernel"]
    assert moe["kind"] == "dense-masked" and moe["layers"] == 2


def test_a_float_program_the_runner_disagrees_with_is_refused(program, mixtral, monkeypatch):
    """The runner's tokens are held to transformers' at fp32: other text is an error naming both."""
    out, _ = program
    plan = plan_export(mixtral, out.parent / "again", target="executorch", quant="f32")

    def other(pte, ptd, tokenizer, prompt, new_tokens):
        return {"text": b" something else", "stats": {}}

    monkeypatch.setattr(runner_check, "runner_generate", other)
    with pytest.raises(ExportError, match="ExecuTorch's runner generated ' something else' where transformers"):
        runner_export._verify(plan[1], plan[2], out / "model.pte", out / "model.ptd", {2})


def test_a_span_under_a_millisecond_gives_no_rate(program, mixtral, monkeypatch):
    """The runner times in whole milliseconds and leaves out the rate of a span that rounds to 0 (a tiny prefill on a
    fast machine): the record says 0 ms and no rate."""
    from transformers import AutoModelForCausalLM

    out, man = program
    stats = {
        "prompt_tokens": man["runner"]["prompt_tokens"],
        "generated_tokens": 16,
        "inference_start_ms": 100,
        "prompt_eval_end_ms": 100,
        "first_token_ms": 100,
        "inference_end_ms": 132,
        "decode_token_per_sec": 500.0,
    }

    def fast(pte, ptd, tokenizer, prompt, new_tokens):
        return {"text": man["runner"]["text"].encode(), "stats": stats}

    monkeypatch.setattr(runner_check, "runner_generate", fast)
    hf = AutoModelForCausalLM.from_pretrained(mixtral)
    got = runner_check.runner_check(out / "model.pte", out / "model.ptd", out, hf, {2})
    assert (got["prefill_ms"], got["prefill_tok_s"]) == (0, None)
    assert (got["decode_ms"], got["decode_tok_s"]) == (32, 500.0)
    assert got["tokens_equal"]


def test_jobs_needs_chunks(mixtral, tmp_path):
    with pytest.raises(ExportError, match="--jobs: ExecuTorch lowers one program unless --chunk-layers"):
        export(mixtral, tmp_path / "o", target="executorch", quant="f32", jobs=2)
    assert not (tmp_path / "o").exists()


def test_the_layers_are_rounded_one_at_a_time(tmp_path, monkeypatch):
    """The float model is never held: each layer is read, rounded and its float weights dropped before the next is
    read (XNNPACK's lowering replaced by a recorder: ``test_the_runner_loads…`` runs it)."""
    from moetool.export.graph.stream import streamed_export_model

    moe = deep_moe_at(tmp_path / "deep")
    plan = plan_export(moe, tmp_path / "plan", target="executorch", quant=QUANT)[2]
    outside, layer = layer_bytes(Checkpoint(moe).config, plan.quant.total_params)
    before = live_tensor_bytes()
    peak = [0]
    src = streamed_export_model(moe)
    read = src.block

    def block(i):
        peak[0] = max(peak[0], live_tensor_bytes() - before)
        return read(i)

    def recorded(model, bounds, metadata, out_dir, step=None):
        peak[0] = max(peak[0], live_tensor_bytes() - before)
        assert sorted(model.layers) == [str(i) for i in range(8)]
        return out_dir / "model.pte", out_dir / "model.ptd"

    monkeypatch.setattr(src, "block", block)
    monkeypatch.setattr(lowering, "write_runner_program", recorded)
    result = lowering.lower_runner(
        src, precisions=plan.precisions(), out_dir=tmp_path, bounds=lowering.Bounds(16, 32), metadata={}
    )
    assert result["quantized_linears"]["int4"] == 8 * 3 * 3  # every expert projection
    # every layer rounded (int8 values and scales: about a third of its float32 bytes) beside the float weights
    # outside the layers and one layer being read; never the float model
    assert peak[0] <= outside + layer + 8 * layer // 2, (peak[0], outside, layer)
    assert peak[0] < plan.quant.total_params * 4 / 2


def test_a_model_without_tokenizer_json_is_refused_before_lowering(mixtral, tmp_path):
    """The runner reads tokenizer.json: a model folder without one is refused before minutes of lowering."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(mixtral, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match="no tokenizer.json, which ExecuTorch's runner reads"):
        export(bare, tmp_path / "o", target="executorch", quant="f32")
    assert not (tmp_path / "o").exists()
