"""The --device and --dtype names every stage resolves alike (moetool.compute.dtypes)."""

from __future__ import annotations

import pytest
import torch

from moetool.compute.dtypes import dtype_name, resolve_device
from moetool.errors import MoetoolError


def test_device_choices():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device(None).type == resolve_device("auto").type
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(MoetoolError, match="--device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(MoetoolError, match="0 CUDA device"):
            resolve_device("cuda:1")


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_device_is_refused_not_taken_for_auto(empty):
    with pytest.raises(MoetoolError, match="--device is empty"):
        resolve_device(empty)


def test_dtype_names_are_configs_names():
    assert dtype_name(torch.bfloat16) == "bfloat16"
