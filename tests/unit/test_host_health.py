"""The host health rule (quart_provider.host_health): down after enough silence, once; back on an answer."""

from __future__ import annotations

import pytest
from quart_provider.host_health import HostHealth


def test_down_after_silence_once_and_back_on_an_answer() -> None:
    health = HostHealth(down_after_s=0.8)
    assert not health.answered("h", 0.0)
    assert not health.failed("h", 0.5)  # silent 0.5 s: not yet
    assert health.is_up("h")
    assert health.failed("h", 0.9)  # silent 0.9 s: down, reported once
    assert not health.failed("h", 1.5)
    assert not health.is_up("h") and health.silent_for("h", 1.5) == 1.5
    assert health.answered("h", 2.0)  # back, reported once
    assert not health.answered("h", 2.2)
    assert health.is_up("h") and health.silent_for("h", 2.5) == pytest.approx(0.3)


def test_a_host_that_never_answered_counts_from_its_first_failure() -> None:
    health = HostHealth(down_after_s=1.0)
    assert not health.failed("h", 10.0)
    assert not health.failed("h", 10.6)
    assert health.failed("h", 11.0)
    assert health.is_up("other")
