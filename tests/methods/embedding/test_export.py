"""Export of routed-embedding models: ONNX graphs that run in onnxruntime and match torch; GGUF refused clearly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import save_dense
from moetool.export.base import ExportError
from moetool.methods.embedding.export import ExportRoutedLM, export_routed
from moetool.methods.embedding.retrofit import retrofit
from moetool.methods.embedding.router import causal_mask

torch.set_num_threads(1)  # the CPU is shared; tiny models gain nothing from more threads

ROUTER = {"width": 16, "layers": 2, "heads": 4, "n_queries": 2}


def build(tmp_path, variant: str, head: str):
    base = save_dense(tmp_path / "base")
    src = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    m = retrofit(src, {"variant": variant, "seed_dim": 8, "n_experts": 3, "top_k": 3, "router": ROUTER}, head=head)
    with torch.no_grad():
        for p in m.embed.parameters():  # as if trained: the router's outputs matter
            p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(str(tmp_path / "m"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "m" / f).write_bytes((base / f).read_bytes())
    return m.eval(), tmp_path / "m"


def test_onnx_parity_two_lengths_and_decode(tmp_path):
    """One export (each takes ~20 s of tracing); the wrapper test below covers the other variants' caches."""
    import onnxruntime as ort

    variant, head = "remix", "seed"
    model, path = build(tmp_path, variant, head)
    manifest = export_routed(path, "onnx", tmp_path / "onnx")
    par = manifest["parity"]
    assert par["seq_lens"] == [32, 128] and max(par["max_abs_logit_diff"].values()) < 1e-4
    assert par["decode"]["max_abs_logit_diff"] < 1e-4 and par["top1_agreement"] == 1.0
    assert json.loads((tmp_path / "onnx" / "manifest.json").read_text())["head"] == head
    # independently of the manifest: the written graph, run here on fresh ids, equals the torch model
    s = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    for t in (9, 40):
        ids = torch.randint(0, 300, (1, t))
        got = s.run(
            None, {"input_ids": ids.numpy(), "position_ids": np.arange(t)[None], "mask": causal_mask(t, 0).numpy()}
        )[0]
        with torch.no_grad():
            ref = model(ids).logits.numpy()
        assert np.abs(got - ref).max() < 1e-4
    with pytest.raises(Exception, match="exists"):
        export_routed(path, "onnx", tmp_path / "onnx")


@pytest.mark.parametrize(("variant", "head"), [("selection", "keep"), ("generative", "seed"), ("dense", "keep")])
def test_export_wrapper_cache_matches(tmp_path, variant, head):
    model, _ = build(tmp_path, variant, head)
    em = ExportRoutedLM(model).eval()
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        ref = model(ids).logits
        out = em(ids[:, :7], torch.arange(7)[None], causal_mask(7, 0))
        past = out[1:]
        step = em(ids[:, 7:], torch.arange(7, 12)[None], causal_mask(5, 7), *past)
    torch.testing.assert_close(torch.cat([out[0], step[0]], 1), ref, atol=1e-4, rtol=1e-4)
    assert len(past) == len(em.past_names("present"))


def test_gguf_and_wrong_inputs_are_refused(tmp_path):
    _, path = build(tmp_path, "generative", "keep")
    with pytest.raises(ExportError, match="llama.cpp has no architecture"):
        export_routed(path, "gguf", tmp_path / "g")
    with pytest.raises(ExportError, match="onnx"):
        export_routed(path, "executorch", tmp_path / "t")
    with pytest.raises(ExportError, match="is not 'moetool_routed_embedding'"):
        export_routed(tmp_path / "base", "onnx", tmp_path / "o")
    assert not (tmp_path / "g").exists() and not (tmp_path / "o").exists()
