"""Hybrid (method: hybrid) Pareto sweep on the zoo: Transformer (zoo:base) vs Mamba (zoo:mamba) behind the router.

Latency profile from either runtime on this machine:
- ``--runtime transformers``: PyTorch/transformers float32 forward (Mamba runs transformers' sequential CPU scan);
- ``--runtime llama.cpp``: both experts exported to GGUF (f32, verified) and timed in llama-cpp-python, i.e. the
  deployed runtime.
Then one router per λ2 (or --parameter) value, each judged on held-out requests against both experts alone and
the oracle, with live routed latency measured on a subset (transformers) and checked against Σ share·latency.

Run:  .venv/bin/python bench/hybrid_pareto.py [--runtime both|llama.cpp|transformers] [--out out/bench/hybrid]
      [--timed 48]      (the expert outputs are computed once and reused for both runtimes)
"""

from __future__ import annotations

import os

# torch's OpenMP threads spin after each op and starve llama.cpp's in the same process: measured here, a 128-token
# Mamba prefill took 140 ms of CPU after a few torch matmuls vs 4 ms before. PASSIVE must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from rich.console import Console

from moetool.methods.hybrid.pareto import sweep, table, write_sweep
from moetool.methods.hybrid.pipeline import load_experts, prepare
from moetool.methods.hybrid.profile import cost_ms, costly_expert, measure_gguf_profile, measure_profile
from moetool.methods.hybrid.zoo_mamba import build_zoo_mamba
from moetool.recipe import load_recipe


def gguf_profile(recipe, recipe_dir: Path, out: Path, console: Console) -> Path:
    """Export each expert to a verified f32 GGUF and time both in llama.cpp; returns the profile JSON path."""
    from moetool.methods.hybrid.export import _export_expert

    experts, _ = load_experts(recipe, recipe_dir)
    files = {}
    for e in experts:
        row = _export_expert(
            {"name": e.name, "path": str(e.path), "model_type": e.model_type},
            out / "gguf" / e.name,
            "gguf",
            "f32",
            True,
            console,
        )
        if not row.get("file"):
            raise SystemExit(f"{e.name}: {row.get('reason')}")
        console.print(f"{e.name}: GGUF verified, top-1 {row['parity']['top1_agreement']:.4f}")
        files[e.name] = out / "gguf" / e.name / row["file"]
    prof = measure_gguf_profile(
        files,
        device="this-machine (llama.cpp)",
        lengths=recipe.profile.lengths,
        repeats=recipe.profile.repeats,
        threads=recipe.profile.threads,
        vocab=len(experts[0].tokenizer),
        clock_name=recipe.profile.clock,
    )
    path = out / "profile-llama.cpp.json"
    path.write_text(json.dumps(prof, indent=2) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=Path("recipes/demo-hybrid.yaml"))
    ap.add_argument("--runtime", choices=["transformers", "llama.cpp", "both"], default="both")
    ap.add_argument("--parameter", default=None)
    ap.add_argument("--values", default=None, help="comma-separated")
    ap.add_argument("--timed", type=int, default=48, help="held-out requests timed live per sweep point")
    ap.add_argument("--out", type=Path, default=Path("out/bench/hybrid"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    console = Console(stderr=True)
    build_zoo_mamba(console=console)
    recipe = load_recipe(args.recipe)
    args.out.mkdir(parents=True, exist_ok=True)
    runtimes = ["llama.cpp", "transformers"] if args.runtime == "both" else [args.runtime]
    if "llama.cpp" in runtimes:
        path = gguf_profile(recipe, args.recipe.parent, args.out / "llama.cpp", console)
        recipe = recipe.model_copy(update={"profile": recipe.profile.model_copy(update={"file": str(path.resolve())})})
    # the slow part (both experts over every request), done once and kept in out/bench/hybrid/outputs.safetensors
    p = prepare(recipe, args.recipe.parent, console, cache=args.out / "outputs.safetensors")
    vals = [float(v) for v in args.values.split(",")] if args.values else None
    for runtime in runtimes:
        if runtime == "transformers" and p.profile.get("runtime", "").startswith("llama.cpp"):
            spec = recipe.profile
            prof = measure_profile(
                {e.name: e.model for e in p.experts},
                device="this-machine (transformers)",
                lengths=spec.lengths,
                repeats=spec.repeats,
                threads=spec.threads,
                vocab=len(p.experts[0].tokenizer),
                clock_name=spec.clock,
            )
            p = with_profile(p, prof)
        for name, e in p.profile["experts"].items():
            f = e["fit"]
            ms = ", ".join(f"L={n}: {1000 * s:.2f}" for n, s in zip(e["lengths"], e["seconds"], strict=True))
            console.print(
                f"[{runtime}] profile {name}: {ms} ms; fit a={1e3 * f['a']:.4f} ms/tok, "
                f"b={1e3 * f['b']:.2e} ms/tok², c0={1e3 * f['c0']:.3f} ms, "
                f"max rel err {100 * f['max_rel_error']:.1f}%"
            )
        console.print(f"[{runtime}] costly expert: {p.names[p.costly]}")
        res = sweep(p, parameter=args.parameter, values=vals, timed_requests=args.timed, console=console)
        res["profile"] = p.profile
        write_sweep(res, args.out / runtime / "pareto", force=True)
        print(f"## {runtime}\n")
        print(table(res))
        print(f"wrote {args.out / runtime / 'pareto'}\n")


def with_profile(p, prof):
    """``p`` with another latency profile: costs and the costly expert recomputed, expert outputs kept."""
    names = p.names
    costly = costly_expert(prof, names, p.recipe.router.max_length) if p.recipe.costly == "auto" else p.costly
    train = dataclasses.replace(p.train, cost=cost_ms(prof, names, p.train.lengths))
    valid = dataclasses.replace(p.valid, cost=cost_ms(prof, names, p.valid.lengths))
    return dataclasses.replace(p, profile=prof, costly=costly, train=train, valid=valid)


if __name__ == "__main__":
    main()
