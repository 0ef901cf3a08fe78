"""Router recalibration after an edit: brief router-only tuning (every expert and the rest frozen) on domain text.

The same loop as ``moetool train`` (:func:`moetool.train.router_tuning.train_router`), with a recipe built here: the
``router_only`` freeze preset and a ``train:`` section from the edit's data and settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from moetool.edit.layout import EditError
from moetool.recipe.train import DataSource, TrainSpec, TuningRecipe


@dataclass(frozen=True)
class Recalibration:
    """Router-only tuning settings; ``steps`` 0 means none."""

    steps: int = 0
    router_learning_rate: float = 0.05
    batch_size: int = 4
    seq_len: int = 128
    seed: int = 0
    load_balancing_coef: float = 0.01

    def __post_init__(self) -> None:
        """Refuse settings the tuning loop would refuse only after the edit is written (or that would reach it as
        NaN): checked when the options are read, before any work.

        Raises:
            EditError: naming the option.
        """
        if self.steps < 0:
            raise EditError(f"--tune-steps {self.steps}: give 0 (no recalibration) or more steps")
        if not math.isfinite(self.router_learning_rate) or self.router_learning_rate <= 0:
            raise EditError(f"--router-lr {self.router_learning_rate}: give a finite learning rate above 0")
        if not math.isfinite(self.load_balancing_coef) or self.load_balancing_coef < 0:
            raise EditError(f"load_balancing_coef {self.load_balancing_coef}: give a finite coefficient, 0 or more")


def data_files(data: dict[str, str] | None) -> list[Path]:
    """The local files among ``NAME → FILE | zoo:DOMAIN`` sources: inputs an edit's output must never replace."""
    return [Path(ref) for ref in (data or {}).values() if not ref.startswith("zoo:")]


def data_sources(data: dict[str, str]) -> dict[str, DataSource]:
    """``NAME → FILE`` (a UTF-8 text file) or ``NAME → zoo:DOMAIN`` as training data sources.

    Raises:
        EditError: a file that does not exist.
    """
    out = {}
    for name, ref in data.items():
        if ref.startswith("zoo:"):
            out[name] = DataSource(zoo=ref.removeprefix("zoo:"))
        elif not Path(ref).is_file():
            raise EditError(f"--data {name}={ref}: no such file")
        else:
            out[name] = DataSource(text=str(Path(ref).resolve()))
    return out


def recalibrate(
    model: Path,
    output: Path,
    data: dict[str, str],
    settings: Recalibration,
    *,
    name: str,
    force: bool = False,
    console: Console | None = None,
    dtype: str | None = None,
    device: str | None = None,
) -> Path:
    """Tune the routers of the MoE at ``model`` on ``data`` and write the result to ``output`` (atomically).

    Raises:
        EditError: no data to tune on.
    """
    from moetool.train.router_tuning import train_router

    if not data:
        raise EditError("router recalibration needs text: give --data NAME=FILE (or NAME=zoo:DOMAIN)")
    spec = TrainSpec(
        data=data_sources(data),
        steps=settings.steps,
        learning_rate=settings.router_learning_rate,
        router_learning_rate=settings.router_learning_rate,
        warmup_steps=min(4, settings.steps - 1),
        batch_size=settings.batch_size,
        seq_len=settings.seq_len,
        seed=settings.seed,
        load_balancing_coef=settings.load_balancing_coef,
        checkpoint_every=max(1, settings.steps),
        log_every=max(1, settings.steps // 4),
    )
    recipe = TuningRecipe(name=name, train=spec)
    train_router(recipe, model, output, force=force, resume=False, console=console, dtype=dtype, device=device)
    return output
