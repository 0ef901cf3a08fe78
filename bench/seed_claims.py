"""The toy zoo's claims in docs/, checked across seeds: reads one output per seed of a method's experiment and prints
each figure per seed, its mean ± half-range, and for each claim "holds in all seeds" or "not supported (k of n)".

    .venv/bin/python bench/seed_claims.py mofe EVAL.json... [--moe tuned-mofe]   # moetool eval / demo eval.json
    .venv/bin/python bench/seed_claims.py comigs out/seeds-comigs/seed-*/comigs_experiment.json
    .venv/bin/python bench/seed_claims.py gem out/seeds-gem/seed-*.json            # bench/gem_experiment.py --json
    .venv/bin/python bench/seed_claims.py embedding out/seeds-embedding/seed-*/report.json
    .venv/bin/python bench/seed_claims.py hybrid out/seeds-hybrid/seed-*/hybrid.json
    .venv/bin/python bench/seed_claims.py pareto out/seeds-hybrid-pareto/seed-*/llama.cpp/pareto/pareto.json
    .venv/bin/python bench/seed_claims.py gem-qat out/seeds-gem-qat/seed-*/gem-report.json   # moetool merge, GEM

Files are taken as seeds in the order given. Figures are perplexities (lower is better) unless a line says otherwise.
For comigs, one seed may be several reports joined by ``+`` (runs of different variants at the same seed, e.g.
``a/comigs_experiment.json+b/comigs_experiment.json``); their Pretrained rows must agree.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DOMAINS = ("code", "legal", "medical")
TABLE2 = ("Local", "FedAvg", "CoMiGS-2S", "CoMiGS-2G", "CoMiGS-1G1S")


def spread(vals: Sequence[float], fmt: str = ".2f", unit: str = "") -> str:
    """``a / b / c: mean ± half-range`` (the half-range with two significant digits)."""
    per = " / ".join(f"{v:{fmt}}{unit}" for v in vals)
    return f"{per}: {statistics.mean(vals):{fmt}} ± {(max(vals) - min(vals)) / 2:.2g}{unit}"


def claim(text: str, flags: Sequence[bool]) -> bool:
    """Print the claim with its verdict: it holds only if it holds in every seed."""
    ok = all(flags)
    verdict = "holds in all seeds" if ok else f"not supported (holds in {sum(flags)} of {len(flags)} seeds)"
    print(f"  claim: {text}: {verdict}")
    return ok


def load(files: Sequence[Path]) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in files]


def user_ppl(r: dict[str, Any], name: str, user: str) -> float:
    """A CoMiGS report row's test perplexity for one user."""
    return float(r[name][user]["test"])


def arm_mean(d: dict[str, Any], arm: str) -> float:
    """An embedding report arm's test perplexity (geometric mean over domains) at its chosen LR."""
    return float(d["arms"][arm]["test"]["mean"])


def join_comigs(paths: Sequence[Path]) -> dict[str, Any]:
    """One seed's CoMiGS reports from separate runs as one: the union of their rows (a row given twice must match)."""
    results: dict[str, Any] = {}
    for path in paths:
        for name, row in json.loads(path.read_text())["results"].items():
            old = results.setdefault(name, row)
            same = all(abs(old[u]["test"] - row[u]["test"]) <= 1e-6 * abs(row[u]["test"]) for u in row)
            if not same:
                raise SystemExit(f"{path}: row {name!r} differs from an earlier report of the same seed")
    return {"results": results}


def mofe(docs: list[dict[str, Any]], moe_key: str) -> None:
    """The README's toy table: the tuned MoE against the best expert on each domain (``moetool eval`` reports)."""
    moe_ppl, best_ppl, best_mean = [], [], []
    for doc in docs:
        ppl = doc["perplexity"]
        names = [m for m in ppl if moe_key in m]
        if len(names) != 1:
            raise SystemExit(f"--moe {moe_key!r} matches {names or 'no model'} in {sorted(ppl)}; it must match one")
        experts = {d: ppl[f"zoo:{d}"] for d in DOMAINS}
        moe_ppl.append({d: ppl[names[0]][d] for d in DOMAINS})
        best_ppl.append({d: min(e[d] for e in experts.values()) for d in DOMAINS})
        best_mean.append(min(statistics.mean(e[d] for d in DOMAINS) for e in experts.values()))
    print(f"mofe: {len(docs)} seeds; MoE = the model whose name contains {moe_key!r}")
    for d in DOMAINS:
        ratios = [m[d] / b[d] for m, b in zip(moe_ppl, best_ppl, strict=True)]
        print(f"  {d}: MoE {spread([m[d] for m in moe_ppl])}; best expert {spread([b[d] for b in best_ppl])}")
        print(f"    MoE ÷ best expert {spread(ratios, '.3f')}")
    means = [statistics.mean(m.values()) for m in moe_ppl]
    print(f"  mean: MoE {spread(means)}; best expert's mean {spread(best_mean)}")
    print(f"    MoE mean ÷ best expert's mean {spread([a / b for a, b in zip(means, best_mean, strict=True)], '.3f')}")
    pairs = list(zip(moe_ppl, best_ppl, strict=True))
    claim("the tuned MoE beats the best expert on every domain", [all(m[d] < b[d] for d in DOMAINS) for m, b in pairs])
    claim(
        "the demo's acceptance: within 5 % of the best expert on every domain, mean below the best expert's mean",
        [
            all(m[d] <= 1.05 * b[d] for d in DOMAINS) and a < e
            for (m, b), a, e in zip(pairs, means, best_mean, strict=True)
        ],
    )


def comigs(docs: list[dict[str, Any]]) -> None:
    """docs/comigs.md's Table-2 claims on the toy zoo (``bench/comigs_experiment.py --seed N`` reports)."""
    res = [d["results"] for d in docs]
    for i, r in enumerate(res[1:], 1):
        if set(r) != set(res[0]):
            raise SystemExit(f"seed {i} has rows {sorted(r)}, seed 0 has {sorted(res[0])}; every seed needs the same")
    users = list(res[0]["Pretrained"])
    print(f"comigs: {len(docs)} seeds; test perplexity per user, and the mean over users")
    for name in res[0]:
        cells = [f"{u} {spread([r[name][u]['test'] for r in res])}" for u in users]
        mean = spread([statistics.mean(r[name][u]["test"] for u in users) for r in res])
        print(f"  {name}: " + "; ".join(cells) + f"; mean {mean}")

    rows = [n for n in TABLE2 if n in res[0]]
    lowest = [min(rows, key=lambda n: statistics.mean(user_ppl(r, n, u) for u in users)) for r in res]
    print(f"  lowest mean of the Table-2 rows per seed: {', '.join(lowest)}")
    claim("1G1S has the lowest mean of the Table-2 rows", [n == "CoMiGS-1G1S" for n in lowest])
    small, one = "legal-small", "CoMiGS-1G1S"
    if small in users and "CoMiGS-2S" in rows:
        claim(
            "legal-small: 2S is worse than the pretrained model (its specialist overfits 4k tokens)",
            [user_ppl(r, "CoMiGS-2S", small) > user_ppl(r, "Pretrained", small) for r in res],
        )
        claim(
            "legal-small: the generalist limits overfitting (1G1S below 2S)",
            [user_ppl(r, one, small) < user_ppl(r, "CoMiGS-2S", small) for r in res],
        )
    if small in users and "CoMiGS-2G" in rows:
        claim(
            "legal-small: full sharing (2G) beats 1G1S",
            [user_ppl(r, "CoMiGS-2G", small) < user_ppl(r, one, small) for r in res],
        )
    if "CoMiGS-2S" in rows and "CoMiGS-2G" in rows:
        for u in users:
            claim(
                f"{u}: 1G1S at or below the worse of 2S and 2G (between them, or below both)",
                [user_ppl(r, one, u) <= max(user_ppl(r, "CoMiGS-2S", u), user_ppl(r, "CoMiGS-2G", u)) for r in res],
            )
    if "CoMiGS-1G1S-tr" in res[0] and small in users:
        claim(
            "legal-small: routers on the train split (-tr) are worse than on validation",
            [user_ppl(r, "CoMiGS-1G1S-tr", small) > user_ppl(r, one, small) for r in res],
        )
    comigs_baselines(res, users)
    comigs_routing(res, users)


def comigs_routing(res: list[dict[str, Any]], users: list[str]) -> None:
    """The 1G1S routers' weight on the generalist per layer (paper Fig. 3 and 5), and what ``-tr`` does to it."""
    key, one, small = "generalist_weight_per_layer", "CoMiGS-1G1S", "legal-small"
    if one not in res[0] or key not in res[0][one][users[0]]:
        return
    w = {u: [r[one][u][key] for r in res] for u in users}
    for u in users:
        layers = zip(*w[u], strict=True)
        print(f"  1G1S generalist weight per layer, {u}: " + "; ".join(spread(list(x), ".2f") for x in layers))
    for u in users:
        claim(
            f"{u}: the generalist's weight falls from the first layer to the last (Fig. 3)",
            [x[-1] < x[0] for x in w[u]],
        )
    if small in users:
        mean = {u: [statistics.mean(x) for x in w[u]] for u in users}
        top = [max(users, key=lambda u: mean[u][i]) for i in range(len(res))]
        claim(f"{small} gives the generalist the most weight of any user", [t == small for t in top])
        if "CoMiGS-1G1S-tr" in res[0]:
            tr = [r["CoMiGS-1G1S-tr"][small][key] for r in res]
            print(
                f"  -tr generalist weight per layer, {small}: "
                + "; ".join(spread(list(x), ".2f") for x in zip(*tr, strict=True))
            )
            claim(
                f"{small}: -tr lowers the generalist's weight in every layer",
                [all(a < b for a, b in zip(t, v, strict=True)) for t, v in zip(tr, w[small], strict=True)],
            )


def comigs_baselines(res: list[dict[str, Any]], users: list[str]) -> None:
    """The heterogeneous 1GXS row, and CoMiGS against the paper's Local and FedAvg baselines."""

    def mean(r: dict[str, Any], name: str) -> float:
        return statistics.mean(user_ppl(r, name, u) for u in users)

    one, gxs = "CoMiGS-1G1S", "CoMiGS-1GXS (recipe)"
    if gxs in res[0] and "medical" in users:
        claim(
            "medical: 1GXS (three specialists) below 1G1S (one)",
            [user_ppl(r, gxs, "medical") < user_ppl(r, one, "medical") for r in res],
        )
        claim("1GXS has a lower mean than 1G1S", [mean(r, gxs) < mean(r, one) for r in res])
        if all(n in res[0] for n in TABLE2):
            rows = [*TABLE2, gxs]
            lowest = [min(rows, key=lambda n: mean(r, n)) for r in res]
            print(f"  lowest mean of the Table-2 rows and 1GXS per seed: {', '.join(lowest)}")
            claim("1GXS has the lowest mean of the Table-2 rows and 1GXS", [n == gxs for n in lowest])
    for base, twin in (("Local", "CoMiGS-2S"), ("FedAvg", "CoMiGS-2G")):
        if base in res[0] and twin in res[0]:
            gap = [max(abs(user_ppl(r, base, u) - user_ppl(r, twin, u)) for u in users) for r in res]
            print(f"  largest |{base} − {twin}| over users: {spread(gap, '.3f')}")
    for base in ("Local", "FedAvg"):
        if base in res[0]:
            claim(f"1G1S has a lower mean than {base}", [mean(r, one) < mean(r, base) for r in res])
            claim(
                f"1G1S beats {base} on every user",
                [all(user_ppl(r, one, u) < user_ppl(r, base, u) for u in users) for r in res],
            )


def _by_tau(router: dict[str, Any], tau: float) -> dict[str, Any]:
    row: dict[str, Any] = {t["tau"]: t for t in router["by_tau"]}[tau]
    return row


def gem(docs: list[dict[str, Any]]) -> None:
    """docs/gem.md's experiment (``bench/gem_experiment.py --seed N --json`` reports): per router variant and
    domain, the out-of-domain cut, the in-domain cost and the fallback rule's effect."""
    print(f"gem: {len(docs)} seeds")
    for v in docs[0]["variants"]:
        runs = [d["variants"][v] for d in docs]
        fallback = [_by_tau(r["router"], 0.7)["fallback"] for r in runs]
        acc = [r["router"]["argmax_accuracy"] for r in runs]
        print(
            f"  router {v}: argmax accuracy {spread(acc, '.3f')}; fallback share at tau 0.7 {spread(fallback, '.3f')}"
        )
        cut_ok, cost_ok, small_ok, helps_ok = [True] * len(runs), [True] * len(runs), [True] * len(runs), []
        for d in docs[0]["variants"][v]["eval"]["experiment"]:
            e = [r["eval"]["experiment"][d] for r in runs]
            cut = [x["ppl_out_of_domain_expert"] / x["ppl_out_of_domain_gem"] for x in e]
            cost = [100 * (x["ppl_in_domain_gem"] / x["ppl_in_domain_expert"] - 1) for x in e]
            fb = [100 * (x["ppl_in_domain_gem"] / x["ppl_in_domain_no_fallback"] - 1) for x in e]
            print(
                f"    {d}: out-of-domain ppl expert ÷ GEM {spread(cut, '.2f', '×')}; in-domain cost over the expert "
                f"{spread(cost, '+.1f', ' %')}; tau 0.7 against tau 0 {spread(fb, '+.2f', ' %')}"
            )
            cut_ok = [a and c > 1 for a, c in zip(cut_ok, cut, strict=True)]
            cost_ok = [a and c < 4 for a, c in zip(cost_ok, cost, strict=True)]
            small_ok = [a and abs(f) < 1 for a, f in zip(small_ok, fb, strict=True)]
            helps_ok.append((d, [f < 0 for f in fb]))
        claim(f"{v}: GEM cuts every expert's out-of-domain perplexity", cut_ok)
        claim(f"{v}: GEM's in-domain cost is under 4 % on every domain", cost_ok)
        claim(f"{v}: the fallback rule changes in-domain perplexity by under 1 % on every domain", small_ok)
        for d, flags in helps_ok:
            if not claim(f"{v}: {d}: the fallback rule helps (tau 0.7 below tau 0)", flags):
                claim(f"{v}: {d}: the fallback rule hurts (tau 0.7 at or above tau 0)", [not f for f in flags])


def gem_qat(docs: list[dict[str, Any]]) -> None:
    """docs/gem.md's QAT figures (``gem-report.json`` of a token-level ``moetool merge``): the quantization penalty
    Σ‖W − Q(W)‖², and per domain the float and fake-quantized perplexity before and after QAT."""
    qat = [d["qat"] for d in docs]
    print(f"gem-qat: {len(docs)} seeds; {qat[0]['steps']} steps, {qat[0]['eval_tokens_per_domain']} tokens per domain")
    first = [q["curve"][0]["quant"] for q in qat]
    last = [q["curve"][-1]["quant"] for q in qat]
    print(f"  penalty at the first logged step {spread(first, '.4g')}; at the last {spread(last, '.4g')}")
    claim("QAT lowers the quantization penalty", [b < a for a, b in zip(first, last, strict=True)])
    better, smaller = [True] * len(qat), [True] * len(qat)
    for d in qat[0]["before"]["float"]:
        fb, fa = [q["before"]["float"][d] for q in qat], [q["after"]["float"][d] for q in qat]
        qb, qa = [q["before"]["fake_quant"][d] for q in qat], [q["after"]["fake_quant"][d] for q in qat]
        cb = [100 * (q / f - 1) for q, f in zip(qb, fb, strict=True)]
        ca = [100 * (q / f - 1) for q, f in zip(qa, fa, strict=True)]
        print(
            f"  {d}: float {spread(fb, '.4g')} → {spread(fa, '.4g')}; quantized {spread(qb, '.4g')} → {spread(qa, '.4g')}"
        )
        print(f"    quantization cost (quantized ÷ float − 1) {spread(cb, '+.2f', ' %')} → {spread(ca, '+.2f', ' %')}")
        better = [ok and a < b for ok, a, b in zip(better, qa, qb, strict=True)]
        smaller = [ok and a < b for ok, a, b in zip(smaller, ca, cb, strict=True)]
    claim("QAT lowers the quantized model's perplexity on every domain", better)
    claim("QAT shrinks the quantization cost on every domain", smaller)


def pareto(docs: list[dict[str, Any]]) -> None:
    """docs/hybrid.md's λ2 sweep (``bench/hybrid_pareto.py`` pareto.json, one per seed): the costly share, the
    expected latency and the routed latency check at every λ2."""
    key = docs[0]["parameter"]
    print(f"pareto: {len(docs)} seeds; {docs[0]['timing']['runtime']} profile; sweep of {key}")
    costly = [d["costly"] for d in docs]
    print(f"  costly expert per seed: {', '.join(costly)}")
    if all("profile" in d for d in docs):  # bench/hybrid_pareto.py adds it; moetool hybrid pareto does not
        for name, e in docs[0]["profile"]["experts"].items():
            at = [1000 * d["profile"]["experts"][name]["seconds"][-1] for d in docs]
            print(f"  profile {name} at L={e['lengths'][-1]}: {spread(at, '.2f', ' ms')}")
    claim(f"{costly[0]} is the costly expert", [c == costly[0] for c in costly])
    for name in docs[0]["baselines"]:
        b = [d["baselines"][name] for d in docs]
        print(
            f"  {name}: {spread([x['perplexity'] for x in b])}; costly share {spread([x['costly_share'] for x in b], '.3f')}"
        )
    rows = [sorted(d["rows"], key=lambda r: r[key]) for d in docs]
    for i, row in enumerate(rows[0]):
        at = [r[i] for r in rows]
        print(
            f"  {key} = {row[key]:g}: {spread([x['perplexity'] for x in at])}; costly share "
            f"{spread([x['costly_share'] for x in at], '.3f')}; expected {spread([x['expected_latency_ms'] for x in at], '.2f', ' ms')}"
        )
    eps = 1e-6
    shares = [[x["costly_share"] for x in r] for r in rows]
    expected = [[x["expected_latency_ms"] for x in r] for r in rows]
    claim(
        f"the costly share never rises with {key}",
        [all(b <= a + eps for a, b in itertools.pairwise(s)) for s in shares],
    )
    claim(f"the costly share is under 1 % at the largest {key}", [s[-1] < 0.01 for s in shares])
    claim(
        f"the expected latency never rises with {key}",
        [all(b <= a + eps for a, b in itertools.pairwise(x)) for x in expected],
    )
    claim(
        "the oracle beats the router at every point",
        [
            all(d["baselines"]["oracle"]["perplexity"] < x["perplexity"] for x in r)
            for d, r in zip(docs, rows, strict=True)
        ],
    )
    alone = [n for n in docs[0]["baselines"] if n.endswith(" alone")]
    claim(
        f"at {key} = {rows[0][0][key]:g} the router beats both experts alone",
        [
            all(r[0]["perplexity"] < d["baselines"][n]["perplexity"] for n in alone)
            for d, r in zip(docs, rows, strict=True)
        ],
    )
    if all("latency_check" in x for r in rows for x in r):
        claim(
            "measured routed latency ≥ Σ share·latency at every point",
            [all(x["latency_check"] for x in r) for r in rows],
        )


def embedding(docs: list[dict[str, Any]]) -> None:
    """docs/embedding.md's fair comparison (``bench/embedding_report.py --seed N`` report.json): mean held-out
    perplexity (geometric mean over domains) of every arm."""
    print(f"embedding: {len(docs)} seeds; test-half perplexity, geometric mean over domains")
    print(f"  original: {spread([d['original']['test']['mean'] for d in docs])}")
    arms = [a for a in docs[0]["arms"] if all(a in d["arms"] for d in docs)]
    for a in arms:
        lrs = ", ".join(f"{d['arms'][a]['best_lr']:g}" for d in docs)
        print(f"  {a}: {spread([d['arms'][a]['test']['mean'] for d in docs])} (chosen lr {lrs})")

    for rival in ("dense-same-params", "dense-same-depth"):
        if "generative" in arms and rival in arms:
            gap = [arm_mean(d, "generative") - arm_mean(d, rival) for d in docs]
            print(f"  generative − {rival}: {spread(gap, '+.2f')}")
            claim(f"{rival} beats generative", [g > 0 for g in gap])
            claim(f"generative beats {rival}", [g < 0 for g in gap])
    embedding_more(docs, arms)


def embedding_more(docs: list[dict[str, Any]], arms: list[str]) -> None:
    """The fair comparison's secondary claims: remix, the cost of halving the table, the paper's LR, latency."""

    orig = [d["original"]["test"]["mean"] for d in docs]
    for a in arms:
        print(f"  {a} ÷ original: {spread([arm_mean(d, a) / o for d, o in zip(docs, orig, strict=True)], '.3f', '×')}")
    if "remix" in arms and "dense-same-width" in arms:
        gap = [arm_mean(d, "remix") - arm_mean(d, "dense-same-width") for d in docs]
        print(f"  remix − dense-same-width: {spread(gap, '+.3f')}")
        claim("remix is no better than dense-same-width", [g >= 0 for g in gap])
    if "dense-same-params" in arms:
        claim(
            "dense-same-params within 1 % of the original",
            [arm_mean(d, "dense-same-params") <= 1.01 * o for d, o in zip(docs, orig, strict=True)],
        )
    if "dense-full-width" in arms:
        claim(
            "training the full-width table does not beat the original",
            [arm_mean(d, "dense-full-width") >= o for d, o in zip(docs, orig, strict=True)],
        )
    high = [a for a in arms if all("0.01" in d["arms"][a]["runs"] for d in docs)]
    if "generative" in high and len(high) > 1:
        worst = []
        for d in docs:
            ratio = {a: d["arms"][a]["runs"]["0.01"]["test"]["mean"] / arm_mean(d, a) for a in high}
            worst.append(max(ratio, key=lambda a: ratio[a]))
            print("  at lr 1e-2 ÷ at the chosen lr: " + ", ".join(f"{a} {r:.3f}" for a, r in ratio.items()))
        claim("at lr 1e-2 generative degrades the most", [w == "generative" for w in worst])
    lat = [d["decode_ms_per_token_batch1"] for d in docs if "decode_ms_per_token_batch1" in d]
    if len(lat) == len(docs):
        for a in lat[0]:
            print(f"  decode {a}: {spread([x[a] for x in lat], '.1f', ' ms/token')}")
        for a in (n for n in lat[0] if n != "original"):
            claim(f"{a} decodes slower than the original", [x[a] > x["original"] for x in lat])


def hybrid(docs: list[dict[str, Any]]) -> None:
    """docs/hybrid.md's "the router beats both experts alone" (``moetool merge`` hybrid.json, one per seed)."""
    rows = [d["held_out"]["rows"] for d in docs]
    print(f"hybrid: {len(docs)} seeds; held-out perplexity and the costly expert's share")
    for name in rows[0]:
        shares = spread([r[name]["costly_share"] for r in rows], ".3f") if "costly_share" in rows[0][name] else ""
        print(
            f"  {name}: {spread([r[name]['perplexity'] for r in rows])}"
            + (f"; costly share {shares}" if shares else "")
        )
    alone = [n for n in rows[0] if n.endswith(" alone")]
    for n in alone:
        gap = [r["router"]["perplexity"] - r[n]["perplexity"] for r in rows]
        print(f"  router − {n}: {spread(gap, '+.2f')}")
    claim(
        "the router beats both experts alone",
        [all(r["router"]["perplexity"] < r[n]["perplexity"] for n in alone) for r in rows],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("method", choices=["mofe", "comigs", "gem", "embedding", "hybrid", "pareto", "gem-qat"])
    ap.add_argument("files", nargs="+", type=Path, help="one report per seed")
    ap.add_argument("--moe", default="tuned-mofe", help="mofe: a substring of the tuned MoE's name in each report")
    args = ap.parse_args()
    if args.method == "comigs":
        docs = [join_comigs([Path(p) for p in str(f).split("+")]) for f in args.files]
    else:
        docs = load(args.files)
    print("seeds: " + ", ".join(str(f) for f in args.files))
    run: dict[str, Callable[[list[dict[str, Any]]], None]] = {
        "mofe": lambda d: mofe(d, args.moe),
        "comigs": comigs,
        "gem": gem,
        "embedding": embedding,
        "hybrid": hybrid,
        "pareto": pareto,
        "gem-qat": gem_qat,
    }
    run[args.method](docs)


if __name__ == "__main__":
    main()
