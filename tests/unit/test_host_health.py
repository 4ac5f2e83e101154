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


def test_one_missed_poll_is_no_outage() -> None:
    """A host must miss ``down_polls`` polls in a row, whatever the silence measured (a long gateway pass
    stretches it): the frontier bench's KeysManager missed one 0.5 s poll and answered 140 ms later."""
    health = HostHealth(down_after_s=0.8, down_polls=2)
    health.answered("h", 0.0)
    assert not health.failed("h", 5.0)  # silent 5 s (the gateway was slow), but one poll missed
    assert health.is_up("h")
    assert not health.answered("h", 5.14)  # it answers again: never down, nothing to adopt back
    assert not health.failed("h", 6.0)
    assert health.failed("h", 6.7)  # two in a row: down
    assert not health.is_up("h")
    assert health.answered("h", 7.0)
