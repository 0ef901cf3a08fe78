"""llama.cpp's own convert_hf_to_gguf.py over every HF folder moetool writes, against transformers and moetool's GGUF.

    .venv/bin/python bench/converter_roundtrip.py [--only CASE ...] [--json out.json]

Tiny models are built from the test fixtures (tests/conftest.py, tests/support): each output architecture from each
base family it accepts, the Qwen2-MoE shared-expert variants, and CoMiGS's baked Mixtral. Each folder is converted
(f32) by the converter of the installed llama-cpp-python (scripts/llama_converter.py), loaded in llama.cpp and
compared with transformers on the same ids (max |Δlogit| over 32 and 128 tokens; the f32 gate is 1e-3). moetool's
own f32 GGUF is written beside it (verification off, measured the same way), and the two files are compared tensor
by tensor when llama.cpp's architecture is the same.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "support")]

from conftest import TEXT, save_dense, write_recipe  # noqa: E402
from moetool.api import assemble, export  # noqa: E402
from moetool.export.gguf.tokenizer import read_vocab  # noqa: E402
from moetool.export.gguf.verify import compare  # noqa: E402

_spec = importlib.util.spec_from_file_location("llama_converter", ROOT / "scripts" / "llama_converter.py")
assert _spec is not None and _spec.loader is not None
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)

PROMPTS = ("def main():", "Permission is hereby granted", "acute bronchitis")
SHARED = "shared_expert: {{source: {base}, positive_prompts: ['def']}}\n"
ZERO_GATE = "shared_expert: {{source: {base}}}\n"  # no prompts: an all-zero shared-expert gate


def mofe_cases() -> dict[str, tuple[str, str]]:
    """case → (dense family, recipe lines): every output architecture from every base family it accepts that the
    fixtures build, with and without its shared expert, and Qwen2-MoE with norm_topk_prob both ways."""
    from conftest import dense_config
    from moetool.arch.outputs import OUTPUT_ARCHS

    cases: dict[str, tuple[str, str]] = {}
    for arch in OUTPUT_ARCHS.values():
        for family in arch.accepts:
            try:
                dense_config(family)
            except KeyError:  # a family the fixtures cannot build
                continue
            pick = f"architecture: {arch.name}\n"
            variants = {"": ""} | ({" shared": SHARED, " shared, zero gate": ZERO_GATE} if arch.shared else {})
            for label, lines in variants.items():
                cases[f"{arch.name}/{family}{label}"] = (family, pick + lines)
                if arch.name == "qwen2_moe":  # llama.cpp's qwen2moe never renormalises the top-k weights
                    cases[f"{arch.name}/{family}{label}, norm_topk=false"] = (
                        family,
                        pick + lines + "norm_topk_prob: false\n",
                    )
    return cases


def _dense(root: Path, family: str) -> dict[str, Path]:
    base = root / f"{family}-base"
    # a mistral base without a sliding window: qwen2_moe refuses one, and the tiny context never reaches it
    kw: dict[str, Any] = {"sliding_window": None} if family == "mistral" else {}
    if not base.exists():
        save_dense(base, family, **kw)
        for i in (1, 2, 3):
            save_dense(root / f"{family}-e{i}", family, seed=i, base=base, mlp_noise=0.3)
    return {"base": base} | {f"e{i}": root / f"{family}-e{i}" for i in (1, 2, 3)}


def _mofe(root: Path, name: str, family: str, extra: str) -> Path:
    m = _dense(root, family)
    experts = "".join(
        f"  - {{name: x{i}, source: {m[f'e{i}']}, positive_prompts: ['{p}']}}\n" for i, p in enumerate(PROMPTS, 1)
    )
    slug = name.replace("/", "-").replace(" ", "").replace(",", "-").replace("=", "")
    text = (
        f"name: {slug}\nmethod: mofe\nbase_model: {m['base']}\nexperts_per_token: 2\n"
        f"{extra.format(base=m['base'])}experts:\n{experts}"
    )
    return assemble(write_recipe(root / f"{slug}.yaml", text), root / slug)


def _comigs(root: Path, variant: str) -> Path:
    """A CoMiGS user trained in process on the fixtures' synthetic tokens, baked into a Mixtral folder."""
    from comigs_fixtures import recipe, tiny_base, user_data

    from moetool.methods.comigs.bake import bake
    from moetool.methods.comigs.federated import prepare, run_inprocess, variant_recipe

    base = tiny_base(root / "comigs")
    r = recipe(base, specialists=(3,), rounds=2, router_every=2, router_steps=2)
    if variant != "comigs":
        r = variant_recipe(r, variant)
    client = run_inprocess(prepare(r, data=user_data(1))).clients[0]
    out = root / f"comigs-{variant}"
    bake(client.model, out, ids=client.data.test[:48].reshape(4, 12), tokenizer_dir=base)
    return out


def _worst(fig: dict[str, float]) -> float:
    vals = list(fig.values())
    return math.nan if any(math.isnan(v) for v in vals) else max(vals)


def run_case(name: str, build: Callable[[], Path], work: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"case": name}
    try:
        moe = build()
    except Exception as e:  # an output moetool cannot build yet is a row too, not the end of the run
        return row | {"output": "?", "build_error": str(e).strip().splitlines()[-1][:160]}
    cfg = json.loads((moe / "config.json").read_text())
    row["output"] = cfg["model_type"]
    if "norm_topk_prob" in cfg and cfg["model_type"] != "mixtral":
        row["norm_topk_prob"] = cfg["norm_topk_prob"]
    pre = read_vocab(moe).pre
    theirs = work / f"{moe.name}-converter.gguf"
    try:
        lc.convert(moe, theirs, outtype="f32", pre=pre)
        row["converter_arch"] = _arch(theirs)
        row["converter_dlogit"] = _worst(compare(theirs, moe, TEXT).max_abs_logit_diff)
    except Exception as e:  # the figure of a failing case is its error, the run goes on
        row["converter_error"] = str(e).strip().splitlines()[-1][:160]
    try:
        man = export(moe, work / f"{moe.name}-own", quant="f32", verify=False)
        ours = work / f"{moe.name}-own" / man["file"]
        row["moetool_arch"] = man["llama_cpp_arch"]
        row["moetool_dlogit"] = _worst(compare(ours, moe, TEXT).max_abs_logit_diff)
        if row.get("converter_arch") == row["moetool_arch"]:
            row["tensor_differences"] = lc.tensor_differences(ours, theirs)
    except Exception as e:
        row["moetool_error"] = str(e).strip().splitlines()[-1][:160]
    return row


def _arch(path: Path) -> str:
    import gguf

    return bytes(gguf.GGUFReader(str(path)).fields["general.architecture"].parts[-1]).decode()


def _fmt(row: dict[str, Any]) -> str:
    def fig(side: str) -> str:
        if f"{side}_error" in row:
            return f"error: {row[f'{side}_error'][:60]}"
        return f"{row.get(f'{side}_arch', '?')} {row.get(f'{side}_dlogit', math.nan):.2e}"

    if "build_error" in row:
        return f"{row['case']:<52} build failed: {row['build_error']}"
    diffs = row.get("tensor_differences")
    same = "n/a" if diffs is None else ("identical" if not diffs else f"{len(diffs)} differ: {diffs[0]}")
    norm = f" norm_topk={row['norm_topk_prob']}" if "norm_topk_prob" in row else ""
    return f"{row['case']:<52} {row['output'] + norm:<26} | {fig('converter'):<24} | {fig('moetool'):<24} | {same}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="case names to run (default: all)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    lc.converter_dir()  # fetch once, before any case
    with tempfile.TemporaryDirectory(prefix="converter-bench-") as tmp:
        root = Path(tmp)
        cases: dict[str, Callable[[], Path]] = {}
        for name, (family, extra) in mofe_cases().items():
            cases[name] = lambda n=name, f=family, x=extra: _mofe(root, n, f, x)
        for variant in ("comigs", "fedavg"):
            cases[f"comigs bake ({variant})"] = lambda v=variant: _comigs(root, v)
        rows = []
        print(f"{'case':<52} {'output':<26} | {'converter (arch, Δ)':<24} | {'moetool GGUF (arch, Δ)':<24} | files")
        for name, build in cases.items():
            if a.only and name not in a.only:
                continue
            rows.append(run_case(name, build, root))
            print(_fmt(rows[-1]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
