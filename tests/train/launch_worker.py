"""One process of the two-process launch in test_multiprocess.py; the launch's start-up is paid once for three runs.

``python launch_worker.py RECIPE MODEL RESUME_OUT STRAIGHT_OUT STOPPED_OUT``:

1. ``moetool train RECIPE --model MODEL -o RESUME_OUT`` through the CLI (it resumes a checkpoint left there);
2. an uninterrupted run into STRAIGHT_OUT;
3. a run into STOPPED_OUT that every process interrupts after step 3 (the main process's checkpoint remains).
"""

from __future__ import annotations

import sys

from moetool.cli import app
from moetool.recipe import load_recipe
from moetool.train.router_tuning import train_router

STOP_AT = 3


def main() -> None:
    recipe, model, resume_out, straight, stopped = sys.argv[1:6]
    app(["train", recipe, "--model", model, "-o", resume_out], standalone_mode=False)
    train_router(load_recipe(recipe), model, straight)

    def stop(step: int, _metrics: dict[str, object]) -> None:
        if step == STOP_AT:
            raise KeyboardInterrupt

    try:
        train_router(load_recipe(recipe), model, stopped, callback=stop)
    except KeyboardInterrupt:
        print(f"stopped after step {STOP_AT}")
        return
    sys.exit("the run was not interrupted")


if __name__ == "__main__":
    main()
