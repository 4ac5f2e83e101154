"""Partitioned models and stacks made once per test module."""

from __future__ import annotations

from pathlib import Path

import pytest
from quart_tools.partition import partition


def partition_emulated(tmp_path_factory, scale_max: int = 4) -> Path:
    """bert-21b in 2 emulated stages (no weights) in a fresh tmp folder; returns its stack.yml."""
    out = tmp_path_factory.mktemp("model")
    partition("bert-21b", 2, str(out), weights="none",
              stack={"compute": "emulated", "scale_min": 1, "scale_max": scale_max}, progress=False)
    return out / "stack.yml"


@pytest.fixture(scope="module")
def emulated_stack(tmp_path_factory) -> Path:
    return partition_emulated(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny1(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("robust") / "tiny1")
    partition("tiny", 1, d, progress=False, seed=3)
    return d

