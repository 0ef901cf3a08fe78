"""A merge whose folder llama.cpp's own converter would turn into a different function says so: at merge time and in
the model card's known limits, naming the ways out; other merges say nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from conftest import save_dense, write_recipe
from moetool.api import assemble, plan


def _recipe(tmp: Path, base: Path, k: int, extra: str = "") -> Path:
    experts = "\n".join(f"  - {{name: x{i}, source: {base}}}" for i in range(3))
    text = (
        f"name: cav\nmethod: mofe\nbase_model: {base}\nexperts_per_token: {k}\ngate_mode: random\n"
        f"{extra}experts:\n{experts}\n"
    )
    return write_recipe(tmp / "r.yaml", text)


@pytest.mark.parametrize(
    ("family", "k", "extra", "warned", "ways"),
    [
        ("qwen2", 2, "norm_topk_prob: true\n", True, ["moetool export --target gguf", "norm_topk_prob: false"]),
        ("qwen2", 2, "shared_expert: {source: BASE}\nnorm_topk_prob: true\n", True, ["norm_topk_prob: false"]),
        ("qwen2", 2, "", False, []),  # the default: un-normalised, as llama.cpp computes a Qwen2-MoE
        ("qwen2", 2, "norm_topk_prob: false\n", False, []),
        ("qwen2", 3, "", False, []),  # top-k of every expert: renormalising changes nothing
        ("llama", 2, "", False, []),
        ("qwen3", 2, "", False, []),
    ],
)
def test_merge_warns_when_llama_cpps_converter_would_differ(tmp_path, family, k, extra, warned, ways):
    base = save_dense(tmp_path / "base", family)
    recipe = _recipe(tmp_path, base, k, extra.replace("BASE", str(base)))
    caveats = [w for w in plan(recipe).warnings if "convert_hf_to_gguf.py" in w]
    assert bool(caveats) == warned
    for way in ways:
        assert way in caveats[0]
    if "shared_expert" in extra:
        assert "moetool export --target gguf" not in caveats[0]  # moetool's exporter refuses that one too
    if "shared_expert" in extra or "false" in extra or k == 3 or family == "qwen3":
        return  # the plan is what the merge prints; two merges below show the printout and the card
    log = Console(record=True, width=300)
    out = assemble(recipe, tmp_path / "moe", console=log)
    assert ("convert_hf_to_gguf.py" in log.export_text()) == warned
    assert ("## Known limits" in (out / "README.md").read_text()) == warned


def test_merge_device_is_checked_and_used(tmp_path):
    """``--device`` places the hidden-state router pass; the CPU gives the same merge as the default here, and a
    device this machine lacks is refused before anything is written."""
    import torch

    from moetool.errors import MoetoolError
    from moetool.io.checkpoint import Checkpoint

    base = save_dense(tmp_path / "base", "llama")
    text = (
        f"name: dev\nmethod: mofe\nbase_model: {base}\nexperts_per_token: 2\ngate_mode: hidden\n"
        "experts:\n"
        + "".join(f"  - {{name: x{i}, source: {base}, positive_prompts: ['prompt {i} words']}}\n" for i in range(3))
    )
    recipe = write_recipe(tmp_path / "r.yaml", text)
    a = assemble(recipe, tmp_path / "a")
    b = assemble(recipe, tmp_path / "b", device="cpu")
    ta, tb = Checkpoint(a), Checkpoint(b)
    assert all(torch.equal(ta.get(n), tb.get(n)) for n in ta.tensors)
    if not torch.cuda.is_available():
        with pytest.raises(MoetoolError, match="CUDA device"):
            assemble(recipe, tmp_path / "c", device="cuda:0")
        assert not (tmp_path / "c").exists()
