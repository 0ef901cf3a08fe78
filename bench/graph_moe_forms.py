"""One decode token through a stack of MoE blocks in three static-graph forms, timed in ExecuTorch (XNNPACK) and
LiteRT: why those two targets keep the MoE dense-masked (the ``reason`` in their manifests' ``moe_kernel``).

    .venv/bin/python bench/graph_moe_forms.py [--model out/demo/tuned-mofe] [--layers 4] [--runtimes executorch,tflite]

Forms (each block adds its routed experts' output to the residual, router in fp32 softmax, top-k renormalised):

- ``dense``: every expert's Linears run, unchosen experts weighted 0 (what the exporters write);
- ``gather``: the token's top-k expert weights picked from stacked ``[E, F, D]`` tensors with ``index_select``,
  then batched matmuls: only k experts computed, but their weights copied every step;
- ``cond``: each expert's Linears under ``torch.cond`` on "chosen by the token": only k experts computed, weights
  in place.

The hidden, intermediate, expert and top-k sizes come from ``--model``'s config.json (the weights are random: only
shapes matter for time). Prints, per runtime and form, ms per call (median of 60), the output's max abs difference
from the torch dense form, and the ratio to the dense form timed in the same run. The LiteRT half runs in
.venv-litert (this script re-invoked). Conversion of ``gather`` takes about two minutes per runtime at SmolLM2 size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

FORMS = ("dense", "gather", "cond")
CALLS = 60


class Expert(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        return out


class Block(nn.Module):
    """One MoE block in ``form``; x [1, 1, H] → x + routed experts."""

    def __init__(self, form: str, h: int, i: int, e: int, k: int) -> None:
        super().__init__()
        self.form, self.k = form, k
        self.router = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(Expert(h, i) for _ in range(e))
        if form == "gather":  # stacked once here: a torch.stack in forward would copy all E experts every call
            for p in ("gate", "up", "down"):
                stacked = torch.stack([getattr(ex, p).weight.detach() for ex in self.experts])
                self.register_buffer(f"{p}_stacked", stacked)  # [E, I, H] gate/up, [E, H, I] down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [1, 1, E]
        top, idx = torch.topk(probs, self.k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        if self.form == "gather":
            return x + self._gather(x, top, idx)
        weights = torch.zeros_like(probs).scatter(-1, idx, top)  # [1, 1, E], 0 for unchosen experts
        out: torch.Tensor = x
        for e, expert in enumerate(self.experts):
            w = weights[..., e : e + 1]
            if self.form == "dense":
                out = out + w * expert(x)
            else:

                def chosen(x: torch.Tensor, w: torch.Tensor, expert: Any = expert) -> torch.Tensor:
                    y: torch.Tensor = w * expert(x)
                    return y

                def skipped(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                    return torch.zeros_like(x)

                branch: torch.Tensor = torch.cond(w.ne(0).any(), chosen, skipped, (x, w))
                out = out + branch
        return out

    def _gather(self, x: torch.Tensor, top: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1]
        pick = idx.reshape(self.k)
        xs = x.reshape(1, h, 1).expand(self.k, h, 1)
        stacked = [getattr(self, f"{p}_stacked") for p in ("gate", "up", "down")]
        g, u, d = (torch.index_select(w, 0, pick) for w in stacked)  # [k, I, H], [k, I, H], [k, H, I]
        y = torch.bmm(d, torch.nn.functional.silu(torch.bmm(g, xs)) * torch.bmm(u, xs))  # [k, H, 1]
        return (y.reshape(self.k, h) * top.reshape(self.k, 1)).sum(0).reshape(1, 1, h)


def stack(form: str, shape: dict[str, int]) -> nn.Module:
    torch.manual_seed(0)  # the same weights in every form
    blocks = [Block(form, shape["h"], shape["i"], shape["e"], shape["k"]) for _ in range(shape["layers"])]
    return nn.Sequential(*blocks).eval()


def _timed(call: Any) -> float:
    call()
    ts = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        call()
        ts.append(1000 * (time.perf_counter() - t0))
    return statistics.median(ts)


def run_executorch(form: str, m: nn.Module, x: torch.Tensor, tmp: Path) -> tuple[float, np.ndarray]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    ep = torch.export.export(m, (x,), strict=True)
    buf = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    path = tmp / f"{form}.pte"
    path.write_bytes(buf)
    method = Runtime.get().load_program(str(path)).load_method("forward")
    return _timed(lambda: method.execute([x])), method.execute([x])[0].numpy()


def run_tflite(form: str, m: nn.Module, x: torch.Tensor, tmp: Path) -> tuple[float, np.ndarray]:
    import litert_torch
    from ai_edge_litert.interpreter import Interpreter

    path = tmp / f"{form}.tflite"
    litert_torch.convert(m, (x,)).export(str(path))
    runner = Interpreter(model_path=str(path)).get_signature_runner()
    feeds = {next(iter(runner.get_input_details())): x.numpy()}
    return _timed(lambda: runner(**feeds)), next(iter(runner(**feeds).values()))


def measure(runtime: str, shape: dict[str, int], tmp: Path) -> dict[str, Any]:
    """Per form: ms per call and max abs diff from torch's dense form, or the error that stopped it."""
    run = run_executorch if runtime == "executorch" else run_tflite
    x = torch.randn(1, 1, shape["h"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = stack("dense", shape)(x).numpy()
    rows: dict[str, Any] = {}
    for form in FORMS:
        t0 = time.perf_counter()
        try:
            ms, got = run(form, stack(form, shape), x, tmp)
        except Exception as exc:  # a form the runtime cannot lower is a result, not a crash
            rows[form] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            continue
        diff = float(np.abs(got - want).max())
        rows[form] = {"ms": ms, "max_abs_diff": diff, "convert_s": time.perf_counter() - t0}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="out/demo/tuned-mofe", help="MoE whose config.json gives the shapes")
    ap.add_argument("--layers", type=int, default=4, help="MoE blocks stacked (weights past the CPU caches)")
    ap.add_argument("--runtimes", default="executorch,tflite")
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)  # internal: RUNTIME, print JSON rows only
    args = ap.parse_args()
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    e = int(cfg.get("num_local_experts") or cfg["num_experts"])
    i = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shape = {"h": cfg["hidden_size"], "i": i, "e": e, "k": cfg["num_experts_per_tok"], "layers": args.layers}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="moetool-forms-") as tmp:
        if args.inner:
            print(json.dumps(measure(args.inner, shape, Path(tmp))))
            return
        print(f"{args.layers} MoE blocks, H {shape['h']}, I {i}, {e} experts, top-{shape['k']}, 1 token, f32\n")
        for runtime in args.runtimes.split(","):
            if runtime == "tflite":
                from moetool.export.tflite.runner import litert_python

                cmd = [litert_python(), __file__, "--model", args.model, "--layers", str(args.layers)]
                proc = subprocess.run([*cmd, "--inner", runtime], capture_output=True, text=True, check=True)
                rows = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                rows = measure(runtime, shape, Path(tmp))
            _print(runtime, rows)


def _print(runtime: str, rows: dict[str, Any]) -> None:
    dense = rows["dense"].get("ms")
    for form, r in rows.items():
        if "error" in r:
            print(f"{runtime:10} {form:7} fails: {r['error']}")
            continue
        ratio = f"{r['ms'] / dense:6.2f}× dense" if dense else ""
        print(f"{runtime:10} {form:7} {r['ms']:9.3f} ms/call  max|diff| {r['max_abs_diff']:.1e}  {ratio}")


if __name__ == "__main__":
    main()
