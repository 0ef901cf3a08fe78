"""Latency profiles: each expert's latency over request lengths on a device, fitted as ``c(L) = a·L + b·L² + c0``.

Measured here (``moetool profile MODEL --device NAME``), or read from a JSON measured on the device (same schema,
``fit`` optional: it is refitted). The operation timed is one forward pass over a request of L tokens at batch 1
(prefill / scoring), float32, after one warm-up; the fastest of ``repeats`` runs counts (moetool is developed on
shared machines: the minimum is the estimate least disturbed by other load; on a quiet device it is within noise of
the median). The profile is stored with
the model as ``latency_profile.json``.

The issue asks for ``a·L + b·L²``; a constant ``c0`` is fitted too, because fixed per-call overhead (framework
dispatch, the LM head) dominates short requests: without it the fit is off by tens of percent below ~32 tokens.
Coefficients are kept non-negative (a term that fits negative is dropped and the rest refitted).
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, Unpack

import torch

from moetool.errors import MoetoolError
from moetool.export.gguf.verify import quiet_stderr
from moetool.methods.hybrid.profile_doc import (
    PROFILE_FORMAT,
    ExpertTimes,
    HowTimed,
    LatencyProfile,
    fit_latency,
    latency_at,
    profile_from_json,
)

if TYPE_CHECKING:
    from llama_cpp import Llama

PROFILE_FILE = "latency_profile.json"
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
InputT = TypeVar("InputT")


class ForwardModel(Protocol):
    """A causal LM timed by its forward pass (a transformers model): ``model(input_ids=ids [1, L])``."""

    def __call__(self, *, input_ids: torch.Tensor) -> object: ...


def clock(name: str) -> Callable[[], float]:
    """``cpu``: CPU seconds of the calling thread. The profiled runs are single-threaded (torch with one thread,
    llama.cpp with n_threads=1 both compute in the caller), so this equals wall time on an idle core, and other
    processes preempting it do not count. Measured here at load ~7 on 2 cores, for llama.cpp on 64 tokens: thread
    7.7 ms, process 25 ms (idle threads of a second context spin), wall 16 ms. ``wall``: ``perf_counter``, for a
    dedicated device or threads > 1."""
    try:
        return CLOCKS[name]
    except KeyError:
        raise MoetoolError(f"clock must be cpu or wall, got {name!r}") from None


def time_forward(model: ForwardModel, input_ids: torch.Tensor, repeats: int, clock_name: str = "cpu") -> float:
    """Fastest of ``repeats`` forward passes of ``input_ids`` ``[1, L]`` after one warm-up (seconds)."""
    now = clock(clock_name)
    with torch.inference_mode():
        model(input_ids=input_ids)
        times = []
        for _ in range(repeats):
            t0 = now()
            model(input_ids=input_ids)
            times.append(now() - t0)
    result: float = min(times)
    return result


def fastest_in_rounds(
    inputs: list[InputT],
    repeats: int,
    now: Callable[[], float],
    run: Callable[[InputT], object],
    prepare: Callable[[InputT], object],
) -> list[float]:
    """Per input, the fastest of ``repeats`` timed ``run(x)`` (seconds on ``now``), each after an untimed
    ``prepare(x)`` (a warm-up pass, a state reset).

    The rounds go over all inputs, not all repeats of one input in a row: a disturbance of a few hundred ms (another
    process, a page-in) then spoils one sample of several lengths instead of every sample of one.
    """
    best = [float("inf")] * len(inputs)
    for _ in range(repeats):
        for j, x in enumerate(inputs):
            prepare(x)
            t0 = now()
            run(x)
            best[j] = min(best[j], now() - t0)
    return best


def _expert_entry(lengths: list[int], seconds: list[float]) -> ExpertTimes:
    return {"lengths": list(lengths), "seconds": seconds, "fit": fit_latency(list(lengths), seconds)}


def time_profile(experts: Mapping[str, ForwardModel], **how: Unpack[HowTimed]) -> LatencyProfile:
    """Time each model in ``experts`` (name → transformers causal LM) at each length on this machine."""
    t = Timing.of(how)
    lengths, repeats, threads, vocab = t.lengths, t.repeats, t.threads, t.vocab
    now = clock(t.clock_name)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    try:
        out: dict[str, ExpertTimes] = {}
        for name, model in experts.items():
            inputs = [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]

            def forward(ids: torch.Tensor, model: ForwardModel = model) -> None:
                model(input_ids=ids)

            with torch.inference_mode():
                out[name] = _expert_entry(lengths, fastest_in_rounds(inputs, repeats, now, forward, forward))
    finally:
        torch.set_num_threads(before)
    return _profile(
        t,
        f"transformers {_transformers_version()} / torch {torch.__version__}, float32, batch 1",
        "one forward pass over a request of L tokens (prefill / scoring), fastest of repeats after a warm-up",
        out,
    )


def timing_llama(path: Path | str, n_ctx: int, threads: int) -> Llama:
    """A llama.cpp model set up for timing a prefill: one batch takes a whole request, only the last logits are
    kept, and the weights are read in at load (no mmap page-ins while timing)."""
    import llama_cpp

    with quiet_stderr():
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=n_ctx,
            n_threads=threads,
            logits_all=False,
            verbose=False,
            use_mmap=False,
        )


def warm_llama(llm: Llama, vocab: int, length: int, seconds: float = 4.0) -> None:
    """Evaluate for ``seconds`` (3 runs at least) before timing: llama.cpp's first seconds after loading run up to
    ~100x slower than steady state (measured here: 1.7 s vs 15 ms for 32 tokens)."""

    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    t0, runs = time.perf_counter(), 0
    while runs < 3 or time.perf_counter() - t0 < seconds:
        llm.reset()
        with quiet_stderr():
            llm.eval(ids)
        runs += 1


def time_gguf_profile(files: dict[str, Path], **how: Unpack[HowTimed]) -> LatencyProfile:
    """Time each expert's GGUF in llama.cpp (llama-cpp-python): prefill of L tokens, fresh state each run."""
    import llama_cpp

    t = Timing.of(how)
    lengths, repeats, threads, vocab = t.lengths, t.repeats, t.threads, t.vocab
    g = torch.Generator().manual_seed(0)
    now = clock(t.clock_name)
    out: dict[str, ExpertTimes] = {}
    for name, path in files.items():
        llm = timing_llama(path, max(lengths), threads)

        def prefill(ids: list[int], llm: Llama = llm) -> None:
            with quiet_stderr():
                llm.eval(ids)

        def reset(_: list[int], llm: Llama = llm) -> None:
            llm.reset()

        try:
            warm_llama(llm, vocab, max(lengths))
            inputs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
            secs = fastest_in_rounds(inputs, repeats, now, prefill, reset)
        finally:
            with quiet_stderr():
                llm.close()
        out[name] = _expert_entry(lengths, secs)
        out[name]["file"] = str(path)
    return _profile(
        t,
        f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), GGUF as exported, batch 1",
        "prefill of a request of L tokens (fresh state), fastest of repeats after a warm-up",
        out,
    )


@dataclass(frozen=True)
class Timing:
    """:class:`HowTimed` with its defaults filled in: the device's name, the request lengths, the vocabulary the
    random requests draw from, the runs per length, the threads and the clock."""

    device: str
    lengths: list[int]
    vocab: int
    repeats: int = 5
    threads: int = 1
    clock_name: str = "cpu"

    @classmethod
    def of(cls, how: HowTimed) -> Timing:
        return cls(**how)


def _profile(t: Timing, runtime: str, operation: str, experts: dict[str, ExpertTimes]) -> LatencyProfile:
    """A measured profile: what was timed, how, on which machine, and each expert's times and fit."""
    return {
        "format": PROFILE_FORMAT,
        "device": t.device,
        "runtime": runtime,
        "operation": operation,
        "threads": t.threads,
        "clock": t.clock_name,
        "repeats": t.repeats,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "experts": experts,
    }


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def load_profile(path: Path, expert_names: list[str]) -> LatencyProfile:
    """Read and check a profile JSON (e.g. measured on a device); refit every expert from its points.

    Raises:
        MoetoolError: naming the file and the field that is missing or wrong.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise MoetoolError(f"{path}: cannot read latency profile: {exc.strerror}") from None
    except ValueError as exc:
        raise MoetoolError(f"{path}: not valid JSON: {exc}") from None
    return profile_from_json(data, expert_names, where=str(path))


# The CLI's plain-dict spellings (cli/methods/hybrid.py passes the profile to a printer typed dict[str, Any]): the
# same documents as load_profile / time_profile / time_gguf_profile, which the rest of the method uses.


def read_profile(path: Path, expert_names: list[str]) -> dict[str, Any]:
    """:func:`load_profile` as a plain dict."""
    return dict(load_profile(path, expert_names))


def measure_profile(experts: Mapping[str, ForwardModel], **how: Unpack[HowTimed]) -> dict[str, Any]:
    """:func:`time_profile` as a plain dict."""
    return dict(time_profile(experts, **how))


def measure_gguf_profile(files: dict[str, Path], **how: Unpack[HowTimed]) -> dict[str, Any]:
    """:func:`time_gguf_profile` as a plain dict."""
    return dict(time_gguf_profile(files, **how))


def cost_ms(profile: LatencyProfile, names: list[str], lengths: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` fitted latency in milliseconds of each expert (``names`` order) at each request length ``[N]``."""
    cols = []
    for name in names:
        fit = profile["experts"][name]["fit"]
        cols.append(torch.tensor([1000.0 * latency_at(fit, float(n)) for n in lengths.tolist()]))
    return torch.stack(cols, dim=1)


def costly_expert(profile: LatencyProfile, names: list[str], max_length: int) -> int:
    """Index of the slower expert at ``max_length`` under the profile's fits."""
    at = [latency_at(profile["experts"][n]["fit"], max_length) for n in names]
    return int(max(range(len(names)), key=lambda i: at[i]))
