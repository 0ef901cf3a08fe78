"""The shipped dispatch.py feeds the router the ids training fed it, whatever the tokenizer's BOS is called."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from moetool.train.data import tokenize_stream

TEMPLATE = Path(__file__).resolve().parents[3] / "src" / "moetool" / "methods" / "hybrid" / "dispatch_template.py"
TEXT = "hello world <s> hello"


def _dispatch_module():
    spec = importlib.util.spec_from_file_location("dispatch_under_test", TEMPLATE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dispatch_under_test"] = mod
    spec.loader.exec_module(mod)
    return mod


def _export_folder(tmp_path: Path, *, record_ids: bool) -> tuple[Path, PreTrainedTokenizerFast]:
    """An export's tokenizer folder for a SmolLM2-like tokenizer: ``<s>`` exists but the BOS is ``<|im_start|>``."""
    vocab = {"<unk>": 0, "<s>": 1, "<|im_start|>": 2, "hello": 3, "world": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|im_start|>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<s>"]})
    root = tmp_path / "export"
    tok.save_pretrained(str(root / "tokenizer"))
    router = {"special_ids": {"bos_token_id": tok.bos_token_id}} if record_ids else {}
    (root / "manifest.json").write_text(json.dumps({"tokenizer": "tokenizer/", "router": router}))
    return root, tok


@pytest.mark.parametrize("record_ids", [True, False], ids=["manifest-ids", "older-export"])
def test_dispatch_ids_equal_training_ids_for_a_bos_that_is_not_s(tmp_path: Path, record_ids: bool) -> None:
    mod = _dispatch_module()
    root, tok = _export_folder(tmp_path, record_ids=record_ids)
    shipped = Tokenizer.from_file(str(root / "tokenizer" / "tokenizer.json"))
    ids = mod.request_ids(shipped, TEXT, mod.trained_bos_id(json.loads((root / "manifest.json").read_text()), root))
    # what training builds (moetool.methods.hybrid.data.sample_requests): BOS, then the stream without specials
    trained = [tok.bos_token_id, *tokenize_stream(tok, TEXT).tolist()]
    assert ids == trained
    assert ids[0] == 2 != tok.convert_tokens_to_ids("<s>")
