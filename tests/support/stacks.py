"""Partitioned models and stacks made once per test module."""

from __future__ import annotations

import pytest
from quart_tools.partition import partition


@pytest.fixture(scope="module")
def emulated_stack(tmp_path_factory):
    from quart_tools.partition import partition

    out = tmp_path_factory.mktemp("model")
    partition("bert-21b", 2, str(out), weights="none", stack={"compute": "emulated", "scale_min": 1, "scale_max": 4},
              progress=False)
    return out / "stack.yml"



@pytest.fixture(scope="module")
def tiny1(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("robust") / "tiny1")
    partition("tiny", 1, d, progress=False, seed=3)
    return d

