"""Training text per domain: zoo corpora, local text or JSONL files, or datasets in the local HF cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

import json
import random
from pathlib import Path

import torch

from moetool.errors import MoetoolError
from moetool.io.safe import read_text
from moetool.io.sources import source_resolver
from moetool.recipe.train import DataSource


def _split_docs(docs: list[str], fraction: float, seed: int) -> tuple[str, str]:
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_valid = max(1, round(len(docs) * fraction)) if len(docs) > 1 else 0
    valid = sorted(order[:n_valid])
    train = sorted(order[n_valid:])
    return "\n\n".join(docs[i] for i in train), "\n\n".join(docs[i] for i in valid)


def load_source(name: str, src: DataSource, *, base_dir: Path | None, fraction: float, seed: int) -> tuple[str, str]:
    """(train text, held-out text) of one domain.

    Raises:
        MoetoolError: the source is missing or empty, naming ``train.data.<name>``.
    """
    where = f"train.data.{name}"
    if src.zoo:
        zoo = source_resolver("zoo")  # the zoo's source plugin: it sits above train, which never imports it
        return zoo.domain_text(src.zoo, "train"), zoo.domain_text(src.zoo, "valid")
    if src.text or src.jsonl:
        raw = Path(src.text or src.jsonl or "")
        path = base_dir / raw if base_dir is not None and not raw.is_absolute() and (base_dir / raw).exists() else raw
        if not path.is_file():
            raise MoetoolError(f"{where}: no such file {raw}")
        if src.text:
            docs = [d for d in read_text(path, what=where, error=MoetoolError).split("\n\n") if d.strip()]
        else:
            docs = []
            for i, line in enumerate(read_text(path, what=where, error=MoetoolError).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    docs.append(str(json.loads(line)[src.field]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise MoetoolError(f"{where}: {path}:{i}: not a JSON object with field {src.field!r}") from None
    else:
        try:
            import datasets
        except ImportError:
            raise MoetoolError(f"{where}: hf_dataset needs the `datasets` package (pip install datasets)") from None
        try:
            ds = datasets.load_dataset(src.hf_dataset, src.hf_config, split=src.split, download_mode=None)
        except Exception as exc:
            raise MoetoolError(f"{where}: {src.hf_dataset!r} is not usable from the local HF cache: {exc}") from None
        docs = [str(x) for x in ds[src.field] if str(x).strip()]
    if not docs:
        raise MoetoolError(f"{where}: no text found")
    return _split_docs(docs, fraction, seed)


def tokenize_stream(tokenizer: PreTrainedTokenizerBase, text: str) -> torch.Tensor:
    """The whole text as one token stream ``[N]`` (no special tokens; windows get BOS at sampling time)."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(
    streams: list[torch.Tensor], batch_size: int, seq_len: int, *, seed: int, step: int, bos_id: int | None
) -> torch.Tensor:
    """A batch ``[B, seq_len]`` of random windows, domains taken in turn; a pure function of (seed, step).

    Depending only on (seed, step) is what makes a resumed run draw exactly the batches an uninterrupted one would.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    body = seq_len - (1 if bos_id is not None else 0)
    rows = []
    for i in range(batch_size):
        s = streams[(step * batch_size + i) % len(streams)]
        if len(s) <= body:
            raise MoetoolError(f"a training domain has only {len(s)} tokens, fewer than seq_len {seq_len}")
        start = int(torch.randint(0, len(s) - body, (1,), generator=g))
        window = s[start : start + body]
        if bos_id is not None:
            window = torch.cat([torch.tensor([bos_id]), window])
        rows.append(window)
    return torch.stack(rows)
