"""Run CoMiGS on Flower's deployment engine on this machine: a SuperLink and one SuperNode per user of the recipe, as
separate processes on 127.0.0.1, with TLS (a fresh local CA) and SuperNode authentication, then ``flwr run`` of this
app, then everything stopped.

    .venv-flwr/bin/python examples/comigs-flower/launch.py recipes/demo-comigs.yaml -o out/comigs-deploy --rounds 2

Certificates, keys, Flower's config (its own FLWR_HOME), the devices' state files and every process's log are kept in
``--workdir`` (default: ``<output>.deploy``). docs/comigs.md shows the same steps on separate machines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moetool.methods.comigs.deploy import LocalDeployment

APP = Path(__file__).resolve().parent
REPO = APP.parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("recipe", type=Path, help="a `method: comigs` recipe")
    p.add_argument("-o", "--output", type=Path, required=True, help="user models and comigs-report.json")
    p.add_argument("--rounds", type=int, default=0, help="0: training.rounds of the recipe")
    p.add_argument("--variant", default="comigs")
    p.add_argument("--workdir", type=Path, help="certificates, keys, state files, logs (default: OUTPUT.deploy)")
    p.add_argument("--flwr-bin", type=Path, default=REPO / ".venv-flwr" / "bin", help="the Flower venv's bin/")
    p.add_argument("--insecure", action="store_true", help="no TLS and no node authentication (Flower's --insecure)")
    p.add_argument("--round-timeout", type=float, default=0, help="seconds per round; 0: Flower's heartbeat")
    p.add_argument(
        "--on-missing", choices=["fail", "drop", "wait"], default="fail", help="a device that does not answer"
    )
    p.add_argument("--timeout", type=float, default=3600, help="the whole run, in seconds")
    a = p.parse_args(argv)
    if not (a.flwr_bin / "flower-superlink").is_file():
        p.error(f"no Flower in {a.flwr_bin}: create it with `bash scripts/setup_comigs.sh`")
    from moetool.recipe import load_recipe

    n_users = len(load_recipe(a.recipe).users)  # type: ignore[union-attr]
    output = a.output.resolve()
    workdir = (a.workdir or output.with_name(output.name + ".deploy")).resolve()
    config = {
        "recipe": str(a.recipe.resolve()),
        "variant": a.variant,
        "output": str(output),
        "rounds": a.rounds,
        "round-timeout": a.round_timeout,
        "on-missing": a.on_missing,
    }
    with LocalDeployment(workdir, n_users, a.flwr_bin.resolve(), secure=not a.insecure) as d:
        print(
            f"SuperLink on 127.0.0.1:{d.port} ({'TLS + node auth' if d.secure else 'insecure'}), {n_users} SuperNodes"
        )
        result = d.run(APP, config, timeout=a.timeout)
    report = output / "comigs-report.json"
    if not result.ok:
        print(result.log[-4000:], file=sys.stderr)
        print(f"launch: run {result.run_id} ended {result.status}; logs in {workdir / 'logs'}", file=sys.stderr)
        return 1
    users = json.loads(report.read_text(encoding="utf-8"))["users"]
    for user, r in users.items():
        print(f"{user}: test perplexity {r['test_ppl']:.4f}")
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
