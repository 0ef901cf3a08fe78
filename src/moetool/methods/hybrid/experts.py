"""Experts of different architectures behind one interface, and the tokenizer check that lets them share requests.

An :class:`Expert` is any causal LM transformers loads (``LlamaForCausalLM``, ``MambaForCausalLM``, …) seen through
the three things the hybrid method needs: per-token log-likelihoods of a request, the cheap encoder's hidden
states, and a timed forward pass. Requests are token ids, so the experts must agree on them: :func:`check_tokenizers`
refuses experts whose vocabularies, special tokens or encodings differ (moetool does not bridge tokenizers).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moetool.errors import MoetoolError
from moetool.io.sources import resolve_source
from moetool.methods.hybrid.records import TokenizerCheck

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SSM_TYPES = ("mamba", "mamba2", "falcon_mamba")
PROBES = (
    "def main():\n    import os\n    return os.path.join('a', 'b')",
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software.",
    "Acute bronchitis due to respiratory syncytial virus; fracture of the femur.",
    "  Mixed   whitespace\tand ünïcödé — 1234567890 !@#$%^&*()",
)


@dataclass
class Expert:
    """One loaded expert. ``kind`` is ``ssm`` for state-space models, ``attention`` otherwise."""

    name: str
    path: Path
    model: Any
    tokenizer: PreTrainedTokenizerBase

    @property
    def model_type(self) -> str:
        return str(self.model.config.model_type)

    @property
    def kind(self) -> str:
        return "ssm" if self.model_type in SSM_TYPES else "attention"

    @property
    def hidden_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[1])

    def _context(self) -> contextlib.AbstractContextManager[None]:
        if self.model_type == "mamba":
            from moetool.methods.hybrid.zoo_mamba import patched_scan

            return patched_scan()  # identical outputs (checked by zoo_mamba.check_fast_scan), faster on CPU
        return contextlib.nullcontext()

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` → ``[B, T, V]`` float32 logits (right padding is harmless: every expert is causal)."""
        with self._context():
            result: torch.Tensor = self.model(input_ids=input_ids).logits.float()
            return result

    @torch.inference_mode()
    def token_logp(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` → ``[B, T-1]``: log p(token t+1 | tokens ≤ t)."""
        logp = torch.log_softmax(self.logits(input_ids)[:, :-1], dim=-1)
        return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)

    @torch.inference_mode()
    def encode(self, input_ids: torch.Tensor, layers: int = 0) -> torch.Tensor:
        """The cheap encoder: ``[B, T]`` → ``[B, T, H]`` token embeddings, or the hidden state after ``layers``."""
        if layers == 0:
            result: torch.Tensor = self.model.get_input_embeddings()(input_ids).float()
            return result
        with self._context():
            out = self.model(input_ids=input_ids, output_hidden_states=True)
        if layers >= len(out.hidden_states):
            raise MoetoolError(f"router.encoder_layers: {layers} but {self.name} has {len(out.hidden_states) - 1}")
        hidden: torch.Tensor = out.hidden_states[layers].float()
        return hidden


def load_expert(name: str, source: str, *, relative_to: Path | None = None) -> Expert:
    """Load expert ``name`` from ``source`` (directory, cached repo id or zoo:NAME) in float32, eval mode.

    Raises:
        SourceError / MoetoolError: the source is missing or not a causal LM, naming the expert.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_source(source, relative_to=relative_to).path
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise MoetoolError(
            f"expert {name!r} ({source} → {path}): cannot load a causal LM and tokenizer: {exc}"
        ) from None
    model.eval()
    return Expert(name=name, path=path, model=model, tokenizer=tokenizer)


def check_tokenizers(experts: list[Expert]) -> TokenizerCheck:
    """Check every expert shares the first one's tokenizer: identical vocab (token → id), special token ids,
    encodings of probe strings, and an embedding table that covers the vocabulary.

    Returns:
        a summary for the manifest (vocab size, special ids, probes checked).

    Raises:
        MoetoolError: naming both experts and the first difference.
    """
    ref = experts[0]
    ref_vocab = ref.tokenizer.get_vocab()
    specials = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    for e in experts[1:]:
        where = f"experts {ref.name!r} ({ref.path}) and {e.name!r} ({e.path})"
        vocab = e.tokenizer.get_vocab()
        if vocab != ref_vocab:
            diff = sorted(set(vocab.items()) ^ set(ref_vocab.items()), key=lambda kv: kv[1])
            tok = diff[0][0]
            raise MoetoolError(
                f"{where} use different tokenizers: vocab sizes {len(ref_vocab)} vs {len(vocab)}, "
                f"{len(diff)} (token, id) pairs differ (first: {tok!r} is {ref_vocab.get(tok)} vs {vocab.get(tok)}); "
                "moetool routes token ids, so both experts need the same tokenizer (it does not bridge them)"
            )
        for attr in specials:
            a, b = getattr(ref.tokenizer, attr), getattr(e.tokenizer, attr)
            if a != b:
                raise MoetoolError(f"{where}: tokenizer {attr} differs ({a} vs {b})")
        for text in PROBES:
            if ref.tokenizer(text)["input_ids"] != e.tokenizer(text)["input_ids"]:
                raise MoetoolError(f"{where}: same vocabulary but different encodings of {text[:40]!r}")
    for e in experts:
        rows = int(e.model.get_input_embeddings().weight.shape[0])
        if rows < len(ref_vocab):
            raise MoetoolError(f"expert {e.name!r} ({e.path}): embedding has {rows} rows < vocabulary {len(ref_vocab)}")
    ids = {a: getattr(ref.tokenizer, a) for a in specials}
    return TokenizerCheck(
        vocab_size=len(ref_vocab),
        special_ids={a: v if isinstance(v, int) else None for a, v in ids.items()},
        probes=len(PROBES),
        identical=True,
    )
