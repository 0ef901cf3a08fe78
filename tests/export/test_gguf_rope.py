"""Scaled rope in a GGUF, proven in llama.cpp against transformers inside and past the original context.

Each case also runs transformers with the rope unscaled on the same weights: the scaled GGUF must match the scaled
model and differ from the unscaled one, so a GGUF that ignored the scaling fails.
"""

from __future__ import annotations

import gguf
import llama_cpp  # noqa: F401  (the dev extra installs it; a missing runtime must fail, not skip)
import numpy as np
import pytest
import torch
from rope_cases import LONG, LONGROPE_ORIG, ORIG, SHORT, rope_kwargs, unscaled_kwargs
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import save_dense, write_recipe
from moetool.api import assemble, export
from moetool.export import ExportError
from moetool.export.gguf.layout import plan_layout
from moetool.export.gguf.rope import llama3_factors, rope_parameters
from moetool.export.gguf.verify import llama_logits, load_llama

EXPERTS = """
experts:
  - {{name: code, source: {e1}, positive_prompts: ["def main():"]}}
  - {{name: legal, source: {e2}, positive_prompts: ["Permission is hereby granted"]}}
"""


def _moe(tmp, family: str, case: str, extra: str = "") -> object:
    base = save_dense(tmp / "base", family, **rope_kwargs(case))
    e = {f"e{i}": save_dense(tmp / f"e{i}", family, seed=i, base=base, mlp_noise=0.3) for i in (1, 2)}
    text = f"name: m\nmethod: mofe\nbase_model: {base}\nexperts_per_token: 2\n{extra}" + EXPERTS.format(**e)
    return assemble(write_recipe(tmp / "m.yaml", text), tmp / "moe")


def _logits(model: object, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0]  # type: ignore[operator]
    return out.numpy()


def _check_in_llama_cpp(model_dir, gguf_path, orig: int) -> dict[int, float]:
    """max |Δlogit| llama.cpp vs transformers at SHORT (< orig) and LONG (> orig) tokens; asserts the unscaled model
    differs by far more at both."""
    assert SHORT < orig < LONG
    scaled = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cfg = AutoConfig.from_pretrained(str(model_dir), **unscaled_kwargs())
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir), config=cfg, dtype=torch.float32).eval()
    diffs = {}
    for n in (SHORT, LONG):
        ids = [int(x) for x in np.random.RandomState(n).randint(4, 300, n)]
        # n_ctx sized to the run: llama.cpp picks longrope's factors by context, transformers by sequence length
        llm = load_llama(gguf_path, n_ctx=n)
        try:
            got = llama_logits(llm, ids)
        finally:
            llm.close()
        diffs[n] = float(np.abs(got - _logits(scaled, ids)).max())
        off = float(np.abs(got - _logits(plain, ids)).max())
        assert diffs[n] <= 1e-3 < off, (n, diffs[n], off)
    return diffs


def _export(model_dir, out) -> tuple[dict, object]:
    man = export(model_dir, out, quant="f32")
    assert max(man["parity"]["max_abs_logit_diff"].values()) <= 1e-3  # the exporter's own check
    return man, out / man["file"]


def test_llama3_moe_writes_rope_freqs(tmp_path):
    moe = _moe(tmp_path, "llama", "llama3")
    man, path = _export(moe, tmp_path / "g")
    assert man["llama_cpp_arch"] == "llama"
    freqs = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "rope_freqs.weight")
    assert freqs.tensor_type.name == "F32" and len(freqs.data) == 4
    _check_in_llama_cpp(moe, path, ORIG)


def test_qwen2_moe_yarn(tmp_path):
    shared = "shared_expert: {source: BASE, positive_prompts: ['def']}\nnorm_topk_prob: false\n"
    moe = _moe(tmp_path, "qwen2", "yarn-attention", shared.replace("BASE", str(tmp_path / "base")))
    man, path = _export(moe, tmp_path / "g")
    assert man["llama_cpp_arch"] == "qwen2moe"
    fields = gguf.GGUFReader(str(path)).fields
    assert bytes(fields["qwen2moe.rope.scaling.type"].parts[-1]).decode() == "yarn"
    assert int(fields["qwen2moe.rope.scaling.original_context_length"].parts[-1][0]) == ORIG
    _check_in_llama_cpp(moe, path, ORIG)


@pytest.mark.parametrize("case", ["linear", "yarn", "longrope"])
def test_dense_llama(tmp_path, case):
    d = save_dense(tmp_path / "d", "llama", **rope_kwargs(case))
    man, path = _export(d, tmp_path / "g")
    _check_in_llama_cpp(d, path, LONGROPE_ORIG if case == "longrope" else ORIG)
    if case == "longrope":
        names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
        assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= names
        assert any("long factors" in n for n in man["notes"])


def test_llama3_factors_equal_transformers():
    """The rope_freqs divisors are exactly transformers' default / llama3 inverse frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=2, **rope_kwargs("llama3"))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    default = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    ours = llama3_factors(rope_parameters(cfg.to_dict()), 32)
    assert np.unique(np.round(ours, 3)).size > 2  # the three regimes: 1, factor, and smoothed between
    np.testing.assert_allclose(ours, (default / scaled).numpy(), rtol=1e-5)


def _cfg(family: str, case: str, **kw: object) -> dict:
    from conftest import dense_config

    return dense_config(family, **(rope_kwargs(case) | kw)).to_dict()  # type: ignore[attr-defined]


def test_refusals_name_the_rope_type_and_the_reason():
    shapes: dict[str, tuple[int, ...]] = {}
    with pytest.raises(ExportError, match=r"config.json: rope_type 'dynamic'.*running sequence length"):
        plan_layout(_cfg("llama", "linear", rope_parameters={"rope_type": "dynamic", "factor": 2.0}), shapes)
    for case in ("llama3", "longrope"):
        with pytest.raises(ExportError, match=rf"rope_type '{case}'.*'qwen2' architecture loads no rope factor"):
            plan_layout(_cfg("qwen2", case), shapes)
    deepseek = dict(rope_kwargs("yarn")["rope_parameters"], mscale=1.0, mscale_all_dim=1.0)
    with pytest.raises(ExportError, match="mscale"):
        plan_layout(_cfg("llama", "yarn", rope_parameters=deepseek), shapes)
