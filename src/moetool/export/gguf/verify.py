"""Proof for a GGUF: llama.cpp (through llama-cpp-python) against transformers on the same token ids.

- tokenizer: llama.cpp's token ids must equal the Hugging Face tokenizer's on strings that stress byte-level BPE;
- logits at two sequence lengths: max |Δ|, top-1 agreement;
- perplexity of both on held-out windows, and its relative change;
- the margin gate over those windows (:mod:`moetool.export.gate`): top-1 agreement where rounding cannot decide it,
  and KL(reference || llama.cpp) under a bound per type family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

    from llama_cpp import Llama
    from llama_cpp.llama_cpp import llama_model_params
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from moetool.export.gguf.dequant import ArtifactTensors

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moetool.export.gate import GateReport, margin_gate
from moetool.export.heldout import Agreement, agreement_of, reference_logits, windows
from moetool.export.parity import ConversionCheck, ParityRecord, TokenizerCheck, TokenizerMismatch
from moetool.export.reference import reference_label, reference_model
from moetool.extras import require

TOKENIZER_PROBES: tuple[str, ...] = (
    "Hello world",
    "naïve café — Überprüfung, 日本語のテキスト, emoji 🤖🚀, Ελληνικά, עברית",
    "a  b   c\t\td\n\ne\r\n   f    \n\t \n",
    "   leading and trailing spaces   ",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "if (a != b && c <= 0x1F) { y = arr[i++]; } // done",
    "don't we'll they've I'm it's 'quoted'",
    "3.14159 1,000,000 2026-11-21 123456789",
    "ICD-10: E11.9 Type 2 diabetes mellitus without complications.",
    "\n",
)


@dataclass
class ParityReport:
    """``conversion``: llama.cpp vs transformers running the artifact's own (dequantized) weights, which isolates
    the conversion; ``original``: vs the source model, which adds what the precision plan costs."""

    tokenizer_mismatches: list[TokenizerMismatch]
    seq_lens: list[int]
    conversion: Agreement
    original: Agreement
    tokens_scored: int
    reference_dtype: str = "float32"  # what the source model's weights are held in; arithmetic is float32
    artifact_dtype: str = "float32"  # what the artifact's dequantized weights are held in
    gate: GateReport | None = None  # the margin gate (None where no plan types were given)
    streamed: bool = False  # both transformers models read from disk one layer at a time (moetool.compute.stream)

    @property
    def tokenizer_match(self) -> bool:
        return not self.tokenizer_mismatches

    @property
    def max_abs_logit_diff(self) -> dict[str, float]:
        return self.conversion.max_abs_logit_diff

    def record(self) -> ParityRecord:
        """The manifest's parity record: the headline figures against the source model (what a user compares
        with), the conversion check, the tokenizer and the margin gate (verdict and tolerance are the exporter's)."""
        conversion = ConversionCheck.of(
            self.conversion,
            f"{reference_label(self.artifact_dtype, self.streamed)}, on the artifact's dequantized weights",
        )
        record = ParityRecord(
            runtime="llama-cpp-python",
            reference=reference_label(self.reference_dtype, self.streamed),
            tokenizer=TokenizerCheck(self.tokenizer_match, len(TOKENIZER_PROBES), tuple(self.tokenizer_mismatches)),
            seq_lens=tuple(self.seq_lens),
            tokens_scored=self.tokens_scored,
            conversion=conversion,
            gate=self.gate,
        )
        return record.with_figures(self.original)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """llama.cpp logs to fd 2 from C; silence it unless MOETOOL_VERBOSE is set."""
    if os.environ.get("MOETOOL_VERBOSE"):
        yield
        return
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


@contextlib.contextmanager
def _extra_buffers(llama_cpp: ModuleType, on: bool) -> Iterator[None]:
    """llama.cpp's ``use_extra_bufts`` model parameter (weight repacking) set to ``on`` while a model loads:
    llama-cpp-python's ``Llama`` takes its parameters from ``llama_model_default_params`` and has no argument for it."""
    if on:
        yield
        return
    binding = llama_cpp.llama_cpp  # the module Llama calls it from
    default: Callable[[], llama_model_params] = binding.llama_model_default_params

    def params() -> llama_model_params:
        out = default()
        out.use_extra_bufts = False
        return out

    binding.llama_model_default_params = params
    try:
        yield
    finally:
        binding.llama_model_default_params = default


def load_llama(
    path: Path,
    n_ctx: int,
    lora_path: Path | None = None,
    *,
    f32_kv: bool = True,
    n_threads: int | None = None,
    why: str = "verifying a GGUF",
    otherwise: str = "pass --no-verify to write an unverified artifact",
    repack: bool = True,
) -> Llama:
    """``path`` in llama-cpp-python with logits kept for every position; ``f32_kv=False`` keeps llama.cpp's default
    f16 KV cache (as users run it). ``n_threads`` defaults to the CPU count, at most 4. ``repack=False`` keeps every
    weight in the mapped file: llama.cpp's CPU backend otherwise copies the q4_0, q4_k and iq4_nl tensors into its
    own interleaved layouts (faster matmuls, and a second, anonymous copy of them: 12.8 GB for a 24B-parameter MoE
    with 4-bit experts)."""
    llama_cpp = require("llama_cpp", "llama", why=why, otherwise=otherwise)
    # an f16 KV cache (llama.cpp's default) alone moves logits by ~5e-3; the parity check is of the weights
    kv = {"type_k": 0, "type_v": 0} if f32_kv else {}
    with quiet_stderr(), _extra_buffers(llama_cpp, repack):
        llm: Llama = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=n_ctx,
            logits_all=True,
            n_threads=n_threads or max(1, min(4, os.cpu_count() or 1)),
            verbose=False,
            lora_path=str(lora_path) if lora_path else None,
            **kv,
        )
    return llm


def llama_logits(llm: Llama, ids: list[int]) -> np.ndarray:
    """[T, V] logits of llama.cpp for ``ids`` (a fresh sequence)."""
    llm.reset()
    with quiet_stderr():
        llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def check_tokenizer(
    llm: Llama, tok: PreTrainedTokenizerBase, equivalent: Callable[[str], str] | None = None
) -> list[TokenizerMismatch]:
    """Strings where llama.cpp's ids differ from the HF tokenizer's (empty when they all agree).

    ``equivalent(text)`` is the text whose HF ids llama.cpp should give for ``text``: the text itself, except where a
    known difference of the vocabulary shifts it (:func:`moetool.export.gguf.tokenizer.llama_cpp_equivalent`: a
    SentencePiece-style vocabulary that transformers loads with a Metaspace that skips the '▁' before a leading space).
    """
    bad = []
    for s in TOKENIZER_PROBES:
        ref = tok(equivalent(s) if equivalent is not None else s).input_ids
        add_bos = bool(ref) and tok.bos_token_id is not None and ref[0] == tok.bos_token_id
        got = llm.tokenize(s.encode("utf-8"), add_bos=add_bos, special=False)
        if list(got) != list(ref):
            bad.append(TokenizerMismatch(text=s, hf=list(ref[:32]), llama_cpp=list(got)[:32]))
    return bad


@dataclass
class LlamaRun:
    """llama.cpp's outputs on held-out text: the token windows it ran (``probes``, one per sequence length, then
    ``ppl_windows``), its logits ``[T, V]`` for each in that order, and where its tokenizer differs from HF's."""

    probes: list[list[int]]
    ppl_windows: list[list[int]]
    logits: list[np.ndarray]
    tokenizer_mismatches: list[TokenizerMismatch]

    def against(self, ref: list[np.ndarray]) -> Agreement:
        """These logits against a transformers run's on the same ids (``ref``: :func:`reference_logits`)."""
        return agreement_of(self.logits, ref, self.probes, self.ppl_windows)

    def transformers_logits(self, model: nn.Module) -> list[np.ndarray]:
        """``model``'s logits on the same ids, in the same order (:func:`reference_logits`)."""
        return reference_logits(model, self.probes + self.ppl_windows)


def run_llama(
    gguf_path: Path,
    tok: PreTrainedTokenizerBase,
    text: str,
    seq_lens: list[int],
    *,
    n_windows: int = 4,
    lora_path: Path | None = None,
    equivalent: Callable[[str], str] | None = None,
    repack: bool = True,
) -> LlamaRun:
    """Load ``gguf_path`` in llama.cpp, check its tokenizer against ``tok`` and run it on windows of ``text`` (one
    per length in ``seq_lens``, then ``n_windows`` of the longest); the one parity run every GGUF writer uses."""
    probes, ppl_windows = windows(tok, text, seq_lens, n_windows)
    llm = load_llama(gguf_path, n_ctx=max(seq_lens), lora_path=lora_path, repack=repack)
    try:
        mismatches = check_tokenizer(llm, tok, equivalent)
        logits = [llama_logits(llm, ids) for ids in probes + ppl_windows]
    finally:
        with quiet_stderr():
            llm.close()
    return LlamaRun(probes, ppl_windows, logits, mismatches)


def compare(
    gguf_path: Path,
    model_dir: Path,
    text: str,
    *,
    artifact_weights: Path | ArtifactTensors | None = None,
    seq_lens: tuple[int, ...] = (32, 128),
    n_windows: int = 4,
    lora_path: Path | None = None,
    equivalent: Callable[[str], str] | None = None,
    dtype: str = "float32",
    artifact_dtype: str | None = None,
    types: set[str] | None = None,
    rounding: dict[str, tuple[str, float, float | None]] | None = None,
    streamed: bool = False,
) -> ParityReport:
    """Run llama.cpp and transformers on the same ids.

    ``model_dir`` is the source model; ``artifact_weights`` a checkpoint holding the artifact's dequantized weights,
    or the artifact's tensors dequantized as each streamed layer reads them (:class:`ArtifactTensors`: no copy on
    disk), or None when they equal the source's, as for f32; ``equivalent`` as in :func:`check_tokenizer`; ``dtype`` the
    dtype the reference holds the source's weights in (float32, or the checkpoint's own 16-bit dtype when float32 does
    not fit in memory; it computes in float32 either way), ``artifact_dtype`` the dtype ``artifact_weights`` are
    held in (default ``dtype``); ``types`` the plan's matrix types, which the margin gate's bounds follow (None: no
    gate), and ``rounding`` each source tensor's (type, relative error) in the artifact
    (:class:`moetool.export.gguf.dequant.ArtifactWeights`); ``streamed``: both transformers models are read from
    disk one layer at a time (:func:`stream_reference`). llama.cpp runs first and lets its copy go, so one model is held at a time; the reference's logits are
    kept (``[T, V]`` per window) for the gate while the dequantized weights run.
    """
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from moetool.compute.stream import release_models

    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    max_pos = int(getattr(AutoConfig.from_pretrained(str(model_dir)), "max_position_embeddings", 2048))
    lens = sorted({min(n, max_pos) for n in seq_lens})
    # streamed, the model does not fit in memory: nor does a repacked copy of its artifact beside the mapped file
    run = run_llama(
        gguf_path, tok, text, lens, n_windows=n_windows, lora_path=lora_path, equivalent=equivalent, repack=not streamed
    )
    ref = run.transformers_logits(reference_model(model_dir, torch_dtype, streamed=streamed))
    release_models()
    own = None
    if isinstance(artifact_weights, Path):
        held = getattr(torch, artifact_dtype or dtype)
        own = run.transformers_logits(reference_model(artifact_weights, held, streamed=streamed))
    elif artifact_weights is not None:  # the source's config over the artifact's tensors, one layer at a time
        own = run.transformers_logits(reference_model(model_dir, torch.float32, tensors=artifact_weights))
    release_models()
    vs_original = run.against(ref)
    n = len(run.probes)
    gate = None if types is None else margin_gate(ref[n:], own[n:] if own else None, run.logits[n:], types, rounding)
    return ParityReport(
        tokenizer_mismatches=run.tokenizer_mismatches,
        seq_lens=lens,
        conversion=vs_original if own is None else run.against(own),
        original=vs_original,
        tokens_scored=sum(len(w) - 1 for w in run.ppl_windows),
        reference_dtype=dtype,
        artifact_dtype=dtype if artifact_weights is None else artifact_dtype or dtype,
        gate=gate,
        streamed=streamed,
    )
