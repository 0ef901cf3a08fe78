"""Benchmark: the same MoE merge with mergekit-moe and with moetool, in the same script.

Builds a synthetic Llama base (hidden 512, 8 layers, vocab 8192, untied; ~130 MB fp32) and four experts (the base
with perturbed MLPs), then for gate modes random, cheap_embed and hidden runs both tools as subprocesses, timing the
wall clock and reading each child's peak RSS from ``wait4``. It then compares the outputs:

- every non-router tensor must be identical (same experts, attention, embeddings);
- with mergekit's router weights copied into moetool's output, logits must match (≤ 1e-5): the MoEs are the same;
- as produced, logits differ because the gate definitions differ (see the printed notes).

The I/O floor (read every input once, write and fsync an output of the merged size) is timed in the same loop.

Run:  bash scripts/setup.sh --bench && .venv/bin/python bench/merge_vs_mergekit.py [--reps 2] [--experts 4]
      [--size 130m|150m] [--no-mergekit] [--mergekit-bin PATH]
``--bench`` installs mergekit in a venv of its own (.venv-mergekit), so its pins never move .venv's packages; that
venv's mergekit-moe is the default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    (["def main():\n    return 0", "import os, sys"], ["the patient was admitted"]),
    (["Permission is hereby granted, free of charge", "WITHOUT WARRANTY OF ANY KIND"], []),
    (["acute bronchitis due to a virus", "fracture of the left femur"], ["class Foo: pass"]),
    (["The for statement iterates over a sequence", "while loops repeat until false"], []),
    (["This program is free software", "licensed under the Apache License"], []),
    (["type 2 diabetes mellitus", "malignant neoplasm of the lung"], []),
    (["lambda x: x + 1", "async def handler(request):"], []),
    (["redistribution in binary form", "the copyright holders"], []),
]


SIZES = {
    # ~130 MB fp32 per model
    "130m": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8},
    # the 150M family of issue 17: ~466 MB fp32 per model, a 1.5 GB Mixtral out with 4 experts
    "150m": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12},
}


def make_models(root: Path, n_experts: int, size: str = "130m") -> dict[str, Path]:
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(topics.values()), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    cfg = LlamaConfig(
        vocab_size=8192,
        **SIZES[size],
        num_key_value_heads=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    paths = {}
    for name in ["base", *[f"expert{i}" for i in range(n_experts)]]:
        model = base
        if name != "base":
            model = LlamaForCausalLM(cfg)
            model.load_state_dict(base.state_dict())
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if ".mlp." in pname:
                        p.add_(torch.randn_like(p) * 0.02)
        paths[name] = root / name
        model.save_pretrained(str(paths[name]))
        fast.save_pretrained(str(paths[name]))
    return paths


def _yaml_list(xs: list[str]) -> str:
    import json

    return json.dumps(xs)


def write_configs(root: Path, paths: dict[str, Path], mode: str, n: int) -> tuple[Path, Path]:
    prompts = mode != "random"
    mk = [f"base_model: {paths['base']}", f"gate_mode: {mode}", "dtype: float32", "experts_per_token: 2", "experts:"]
    mt = [
        "name: bench",
        "method: mofe",
        f"base_model: {paths['base']}",
        f"gate_mode: {mode}",
        "dtype: float32",
        "experts_per_token: 2",
        "experts:",
    ]
    for i in range(n):
        pos, neg = PROMPTS[i % len(PROMPTS)]
        mk.append(f"- source_model: {paths[f'expert{i}']}")
        mt.append(f"- name: e{i}\n  source: {paths[f'expert{i}']}")
        if prompts:
            mk.append(f"  positive_prompts: {_yaml_list(pos)}")
            mt.append(f"  positive_prompts: {_yaml_list(pos)}")
            if neg:
                mk.append(f"  negative_prompts: {_yaml_list(neg)}")
                mt.append(f"  negative_prompts: {_yaml_list(neg)}")
    (root / f"mk-{mode}.yml").write_text("\n".join(mk) + "\n")
    (root / f"mt-{mode}.yaml").write_text("\n".join(mt) + "\n")
    return root / f"mk-{mode}.yml", root / f"mt-{mode}.yaml"


# A forked child starts with its parent's RSS high-water mark, and this script holds models in memory; so each tool
# is started from a small launcher process whose own footprint is a few MB, and the launcher reports wait4's peak.
_LAUNCHER = """
import os, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = p.stderr.read()
_, status, usage = os.wait4(p.pid, 0)
wall = time.perf_counter() - t0
if os.waitstatus_to_exitcode(status):
    sys.stderr.write(err.decode()); sys.exit(1)
print(wall, usage.ru_maxrss / 1024)
"""


def run(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and the command's peak RSS in MB."""
    res = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, *cmd], capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr}")
    wall, rss = res.stdout.split()
    return float(wall), float(rss)


_FLOOR = """
import os, sys, time
from pathlib import Path
inputs, out_bytes, out = [Path(p) for p in sys.argv[1:-2]], int(sys.argv[-2]), Path(sys.argv[-1])
t0 = time.perf_counter()
for d in inputs:
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
buf = bytes(64 << 20)
with open(out, "wb") as fh:
    left = out_bytes
    while left > 0:
        left -= fh.write(buf[: min(left, len(buf))])
    fh.flush()
    os.fsync(fh.fileno())
out.unlink()
print(time.perf_counter() - t0)
"""


def io_floor(inputs: list[Path], out_bytes: int, scratch: Path) -> float:
    """Seconds to read every input checkpoint once and write (and fsync) an output of ``out_bytes``: what any merge
    must do at least. The page cache is as warm as for the tools (they run right before and after)."""
    cmd = [sys.executable, "-S", "-c", _FLOOR, *map(str, inputs), str(out_bytes), str(scratch)]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def compare(mk_out: Path, mt_out: Path) -> dict[str, float]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    a = AutoModelForCausalLM.from_pretrained(str(mk_out), dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(mt_out), dtype=torch.float32).eval()
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb), set(sa) ^ set(sb)
    router = [k for k in sa if k.endswith("mlp.gate.weight")]
    other = max((sa[k] - sb[k]).abs().max().item() for k in sa if k not in router)
    ids = torch.randint(4, 8192, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        as_built = (a(ids).logits - b(ids).logits).abs().max().item()
        cos = statistics.mean(torch.nn.functional.cosine_similarity(sa[k], sb[k], dim=-1).mean().item() for k in router)
        for k in router:
            sb[k].copy_(sa[k])
        same_router = (a(ids).logits - b(ids).logits).abs().max().item()
    return {
        "non_router_max_abs": other,
        "logits_as_built": as_built,
        "logits_same_router": same_router,
        "router_cosine": cos,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--modes", default="random,cheap_embed,hidden")
    ap.add_argument("--size", choices=sorted(SIZES), default="130m")
    ap.add_argument("--no-mergekit", action="store_true", help="moetool against the I/O floor only")
    ap.add_argument(
        "--mergekit-bin",
        type=Path,
        help="the mergekit-moe to run (default: .venv-mergekit's, then .venv's, then PATH's)",
    )
    args = ap.parse_args()
    mergekit = None
    if args.mergekit_bin and not args.no_mergekit:
        if not os.access(args.mergekit_bin, os.X_OK):
            sys.exit(f"--mergekit-bin {args.mergekit_bin}: not an executable file")
        mergekit = str(args.mergekit_bin)
    elif not args.no_mergekit:
        side = ROOT / ".venv-mergekit" / "bin"
        mergekit = (
            shutil.which("mergekit-moe", path=str(side))
            or shutil.which("mergekit-moe", path=str(BIN))
            or shutil.which("mergekit-moe")
        )
        if not mergekit:
            sys.exit("mergekit-moe not found: bash scripts/setup.sh --bench, --mergekit-bin PATH, or --no-mergekit")
    moetool = str(BIN / "moetool")
    root = Path(tempfile.mkdtemp(prefix="moetool-bench-"))
    try:
        paths = make_models(root, args.experts, args.size)
        size = sum(f.stat().st_size for f in paths["base"].glob("*.safetensors")) / 1e6
        print(f"models: base + {args.experts} experts, {size:.0f} MB each (fp32); {os.cpu_count()} CPUs")
        print(f"{'mode':<12} {'tool':<9} {'wall s':>8} {'peak RSS MB':>12}")
        rows = []
        tools = ["floor", "moetool", *(["mergekit"] if mergekit else [])]
        for mode in args.modes.split(","):
            mk_cfg, mt_cfg = write_configs(root, paths, mode, args.experts)
            res: dict[str, list[tuple[float, float]]] = {t: [] for t in tools}
            for _ in range(args.reps):  # interleaved, so machine noise hits every tool alike
                mt_out = root / f"mt-out-{mode}"
                res["moetool"].append(run([moetool, "merge", str(mt_cfg), "--output", str(mt_out), "--force"]))
                out_bytes = sum(f.stat().st_size for f in mt_out.glob("*.safetensors"))
                inputs = [paths["base"], *(paths[f"expert{i}"] for i in range(args.experts))]
                res["floor"].append((io_floor(inputs, out_bytes, root / "floor.bin"), 0.0))
                if mergekit:
                    mk = [mergekit, str(mk_cfg), str(root / f"mk-out-{mode}"), "--random-seed", "0"]
                    res["mergekit"].append(run(mk))
            med = {t: (statistics.median(w for w, _ in r), max(m for _, m in r)) for t, r in res.items()}
            for tool, (w, m) in med.items():
                print(f"{mode:<12} {tool:<9} {w:>8.2f} {m if tool != 'floor' else float('nan'):>12.0f}")
            cmp = compare(root / f"mk-out-{mode}", root / f"mt-out-{mode}") if mergekit else None
            rows.append((mode, med, cmp))
        print("\nratios (lower is better): moetool wall / I/O floor, and against mergekit when it ran")
        print(f"{'mode':<12} {'÷ floor':>8} {'÷ mergekit wall':>16} {'÷ mergekit RSS':>15}")
        for mode, med, _ in rows:
            mk_w = f"{med['moetool'][0] / med['mergekit'][0]:.2f}" if mergekit else "-"
            mk_m = f"{med['moetool'][1] / med['mergekit'][1]:.2f}" if mergekit else "-"
            print(f"{mode:<12} {med['moetool'][0] / med['floor'][0]:>8.2f} {mk_w:>16} {mk_m:>15}")
        if mergekit:
            print_comparison([(mode, c) for mode, _, c in rows if c is not None])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def print_comparison(rows: list[tuple[str, dict[str, float]]]) -> None:
    print(f"\n{'mode':<12} {'non-router Δ':>13} {'Δlogit same router':>19} {'Δlogit as built':>16} {'router cos':>11}")
    for mode, c in rows:
        print(
            f"{mode:<12} {c['non_router_max_abs']:>13.1e} {c['logits_same_router']:>19.1e} "
            f"{c['logits_as_built']:>16.2e} {c['router_cosine']:>11.3f}"
        )
    print(
        "\nWhy the routers differ:\n"
        "- random: mergekit draws N(0, 1) unscaled; moetool N(0, 1/H) (nn.Linear's scale). Top-k routing only\n"
        "  depends on the ordering of logits, but the softmax weights differ.\n"
        "- cheap_embed: mergekit sums embeddings over all tokens including BOS, normalises positives and\n"
        "  negatives separately, then their difference; moetool averages over content tokens (BOS excluded),\n"
        "  per prompt, subtracts, then normalises.\n"
        "- hidden: mergekit takes the residual stream entering each layer at the last token, in bf16;\n"
        "  moetool takes what the router receives (the post-attention RMSNorm output) averaged over each\n"
        "  prompt's content tokens, in fp32.\n"
        "With mergekit's router copied in, the logits match: both tools build the same MoE otherwise."
    )


if __name__ == "__main__":
    main()
