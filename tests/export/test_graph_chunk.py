"""How a graph export is cut into chunks of decoder layers (Core ML packages, ExecuTorch programs, TFLite models):
balanced, sized by float32 bytes, the first and last lighter by the embedding and head they also convert."""

from __future__ import annotations

import pytest

from moetool.export import ExportError
from moetool.export.graph.chunk import chunk_ranges, end_bytes

MIB = 1 << 20
CHUNK = 256 * MIB


def test_chunks_are_balanced_and_sized_by_float32_bytes():
    assert chunk_ranges(8, 100, CHUNK, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert chunk_ranges(30, 100, CHUNK, 12) == [(0, 10), (10, 20), (20, 30)]  # 3 chunks of 10, not 12 + 12 + 6
    assert chunk_ranges(4, 1, CHUNK, None) == [(0, 4)]  # a small model is one package
    assert len(chunk_ranges(24, 900 * MIB, CHUNK, None)) == 24  # a layer over the chunk size is a chunk of its own
    with pytest.raises(ExportError, match="at least one decoder layer"):
        chunk_ranges(8, 100, CHUNK, 0)


def test_the_first_and_last_chunks_count_the_embedding_and_head():
    """The size ladder's 360M shape with 4 experts: 128 MB of float32 per layer, a 189 MB tied embedding. Two layers
    fill a chunk; the first and last hold one beside the embedding or the head, so no chunk converts much more than
    the chunk size (two layers and the embedding would be 445 MB)."""
    layer, end = 128_000_000, 189_000_000
    ranges = chunk_ranges(32, layer, CHUNK, None, end)
    assert ranges[0] == (0, 1) and ranges[-1] == (31, 32)
    assert {b - a for a, b in ranges[1:-1]} == {2} and len(ranges) == 17
    assert chunk_ranges(32, layer, CHUNK, None) == chunk_ranges(32, layer, CHUNK, 2)  # unless the ends are not counted
    # --chunk-layers is taken as given; a model that fits whole with its embedding and head stays one chunk
    assert chunk_ranges(32, layer, CHUNK, 2, end) == chunk_ranges(32, layer, CHUNK, 2)
    assert chunk_ranges(4, 10 * MIB, CHUNK, None, 100 * MIB) == [(0, 4)]
    assert chunk_ranges(3, 100 * MIB, CHUNK, None, 100 * MIB) == [(0, 1), (1, 2), (2, 3)]


def test_end_bytes_are_the_embedding_or_the_untied_head():
    config = {"vocab_size": 1000, "hidden_size": 10, "num_hidden_layers": 2}
    assert end_bytes(config, 1_000_000) == 1000 * 10 * 4
    assert end_bytes(config | {"tie_word_embeddings": False}, 1_000_000) == 1000 * 10 * 4


def test_chain_step_through_loaded_chunks_equals_the_whole_model():
    """Prefill then cached decode, one call through three chunks each with its cache: the whole ExportLM's logits."""
    import torch
    import transformers

    from moetool.export.graph.chunk import ExportChunk, chain_step
    from moetool.export.graph.model import ExportLM, causal_mask, prefill_inputs

    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    em = ExportLM(transformers.AutoModelForCausalLM.from_config(cfg).eval()).eval()
    spans = [(0, 1), (1, 4), (4, 5)]
    chunks = [
        ExportChunk(em, {i: em.layers[i] for i in range(a, b)}, first=a == 0, last=b == 5).eval() for a, b in spans
    ]

    def runner(chunk):  # type: ignore[no-untyped-def]
        def run(x, pos, mask, past):  # type: ignore[no-untyped-def]
            out = chunk(x, pos, mask, *(past or []))
            return out[0], list(out[1:])

        return run

    ids = torch.randint(0, 64, (1, 11))
    with torch.no_grad():
        logits, pasts = chain_step([runner(c) for c in chunks], ids[:, :8], 0, None)
        whole = em(*prefill_inputs(ids[:, :8]))
        assert (logits - whole[0]).abs().max() <= 1e-5
        assert [len(p) for p in pasts] == [2, 6, 2]  # k and v per layer of each chunk
        past = list(whole[1:])
        for t in range(8, 11):
            logits, pasts = chain_step([runner(c) for c in chunks], ids[:, t : t + 1], t, pasts)
            whole = em(ids[:, t : t + 1], torch.tensor([[t]]), causal_mask(1, t), *past)
            past = list(whole[1:])
            assert (logits - whole[0]).abs().max() <= 1e-5
