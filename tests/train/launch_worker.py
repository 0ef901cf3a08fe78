"""One process of a launched router-tuning run that stops after a given step, as an interrupted run would.

``python launch_worker.py RECIPE MODEL OUTPUT STOP_AT``: every process raises from the step callback after step
``STOP_AT``; the main process's last checkpoint remains for a resume.
"""

from __future__ import annotations

import sys

from moetool.recipe import load_recipe
from moetool.train.router_tuning import train_router


def main() -> None:
    recipe, model, output, stop_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    def stop(step: int, _metrics: dict[str, object]) -> None:
        if step == stop_at:
            raise KeyboardInterrupt

    try:
        train_router(load_recipe(recipe), model, output, callback=stop)
    except KeyboardInterrupt:
        print(f"stopped after step {stop_at}")
        return
    sys.exit("the run was not interrupted")


if __name__ == "__main__":
    main()
