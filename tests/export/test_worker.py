"""A step run in a Python process of its own: its result comes back, and a failure is an error naming the step,
the interpreter and what the worker said."""

from __future__ import annotations

import sys

import pytest

from moetool.export.base import ExportError
from moetool.export.worker import run_worker


def test_a_worker_result_comes_back(tmp_path):
    """The ExecuTorch lowering's worker module, asked for a chunk of a model that is not there: its own error (the
    missing checkpoint) comes back as the step's error, with the interpreter it ran in."""
    with pytest.raises(ExportError, match="ExecuTorch lowering failed in") as err:
        run_worker(
            "moetool.export.executorch.lowering",
            {"model_dir": str(tmp_path / "absent"), "layers": [0, 1], "first": True, "last": True, "precisions": {},
             "path": str(tmp_path / "p.pte")},
            what="ExecuTorch lowering",
        )  # fmt: skip
    assert sys.executable in str(err.value) and "absent" in str(err.value)
    assert not (tmp_path / "p.pte").exists()


def test_a_worker_that_is_no_module_is_named(tmp_path):
    with pytest.raises(ExportError, match=r"(?s)the step failed in .*No module named moetool\.absent"):
        run_worker("moetool.absent", {}, what="the step")
