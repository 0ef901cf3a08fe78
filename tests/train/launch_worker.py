"""One process of the two-process launch in test_multiprocess.py; the launch's start-up is paid once for three runs.

``python launch_worker.py RECIPE MODEL RESUME_OUT STRAIGHT_OUT STOPPED_OUT``:

1. ``moetool train RECIPE --model MODEL -o RESUME_OUT`` through the CLI (it resumes a checkpoint left there);
2. an uninterrupted run into STRAIGHT_OUT;
3. a run into STOPPED_OUT that every process interrupts after step 3 (the main process's checkpoint remains).

Under an FSDP launch each process then loads MODEL sharded once more and prints the share of the weights it holds.
"""

from __future__ import annotations

import sys

import torch

from moetool.cli import app
from moetool.recipe import load_recipe
from moetool.train.router_tuning import train_router
from moetool.train.sharded import fsdp_requested, is_sharded, load_sharded

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
    else:
        sys.exit("the run was not interrupted")
    if fsdp_requested():
        report_share(model)


def report_share(model: str) -> None:
    """Print ``rank R holds H of T frozen weights`` for this process after a sharded load."""
    import torch.distributed as dist

    loaded, _ = load_sharded(model, torch.float32, torch.float32, ("mofe", [], []), torch.device("cpu"), 2)
    frozen = [p for p in loaded.parameters() if not p.requires_grad]
    held = sum(p.to_local().numel() if is_sharded(p) else p.numel() for p in frozen)
    print(f"rank {dist.get_rank()} holds {held} of {sum(p.numel() for p in frozen)} frozen weights")


if __name__ == "__main__":
    main()
