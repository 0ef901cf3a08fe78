"""The tiny MoE and its one-process tuning run that the multi-process tests (DDP and FSDP) compare against."""

from __future__ import annotations

import pytest
from tuning_fixtures import write_tuning_recipe

from moetool.api import assemble
from moetool.recipe import load_recipe
from moetool.train.router_tuning import train_router


@pytest.fixture(scope="session")
def moe(tiny_models, tmp_path_factory):
    """(recipe path, merged MoE, the output of one uninterrupted single-process run)."""
    m = tiny_models("llama")
    d = tmp_path_factory.mktemp("multiprocess")
    recipe = write_tuning_recipe(d, m, steps=4)
    model = assemble(recipe, d / "moe")
    train_router(load_recipe(recipe), model, d / "one")
    return recipe, model, d / "one"
