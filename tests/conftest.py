"""Shared test configuration: `slow` tests (big models, long benchmarks) run only with QUART_SLOW=1."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("QUART_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test; set QUART_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gw(tmp_path):
    """The embedded gateway in a thread (tests/test_gateway_api.py ``Running``), closed after the test."""
    from test_gateway_api import Running

    running = Running(tmp_path)
    try:
        yield running
    finally:
        running.close()
