"""The traffic kick's rule (gateway_plugin.kick) and the rates it reads (StageMetrics.recent_rate), pure."""

from __future__ import annotations

import pytest
from gateway_plugin.kick import KickConfig, Kicker, armed_rate, kick_due
from gateway_plugin.metrics import StageMetrics

CFG = KickConfig(surge=2.0, min_interval_s=0.25, min_arrivals=8, min_span_s=0.2)


def test_a_stage_is_armed_at_surge_times_the_capacity_asked_or_the_rate_seen() -> None:
    assert armed_rate(desired=5, slots=1, service_rate=58.0, rate_seen=140.0, surge=2.0) == pytest.approx(580.0)
    assert armed_rate(desired=1, slots=1, service_rate=58.0, rate_seen=300.0, surge=2.0) == pytest.approx(600.0)
    assert armed_rate(desired=2, slots=4, service_rate=10.0, rate_seen=0.0, surge=2.0) == pytest.approx(160.0)
    # capacity unknown (no service time yet) and nothing seen: the first measurable traffic kicks
    assert armed_rate(desired=1, slots=1, service_rate=0.0, rate_seen=0.0, surge=2.0) == 0.0


def test_an_arrival_kicks_only_a_measured_surge_outside_the_bound() -> None:
    due = {"now": 10.0, "rate": 300.0, "arrivals": 30, "span_s": 1.0, "armed": 116.0, "last_s": 9.0, "cfg": CFG}
    assert kick_due(**due)
    assert not kick_due(**{**due, "rate": 115.0}), "below the armed rate"
    assert not kick_due(**{**due, "arrivals": 7}), "too few arrivals to trust a rate"
    assert not kick_due(**{**due, "span_s": 0.1}), "too short a span of traffic"
    assert not kick_due(**{**due, "last_s": 9.8}), "within min_interval_s of the last decision"
    assert kick_due(**{**due, "last_s": 9.75}), "exactly min_interval_s after it"
    assert not kick_due(**{**due, "cfg": KickConfig(enabled=False)}), "switched off"


def test_the_kicker_bounds_a_storm_to_one_kick_per_interval() -> None:
    kicker = Kicker(CFG)
    kicker.arm("f", desired=1, slots=1, service_rate=50.0, rate_seen=0.0)
    kicker.decided(0.0)
    kicked = [t / 1000 for t in range(0, 2000, 5)  # an arrival every 5 ms at 10 000 req/s for 2 s
              if kicker.check("f", t / 1000, rate=10_000.0, arrivals=100, span_s=1.0)]
    assert kicked == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75])
    assert kicker.kicks == len(kicked)


def test_a_decision_rearms_the_stage_and_restarts_the_bound() -> None:
    kicker = Kicker(CFG)
    kicker.arm("f", desired=1, slots=1, service_rate=50.0, rate_seen=0.0)  # armed at 100/s
    assert kicker.check("f", 1.0, rate=140.0, arrivals=40, span_s=0.3)
    kicker.decided(1.0)
    kicker.arm("f", desired=4, slots=1, service_rate=50.0, rate_seen=140.0)  # the kicked decision asked 4: 400/s
    assert not kicker.check("f", 1.5, rate=300.0, arrivals=300, span_s=1.3), "the surge the decision followed"
    kicker.decided(2.0)  # a tick
    assert not kicker.check("f", 2.1, rate=900.0, arrivals=900, span_s=2.1), "the tick restarts the bound"
    assert kicker.check("f", 2.3, rate=900.0, arrivals=900, span_s=2.3), "a new surge beyond 2 × what was asked"


def test_the_recent_rate_of_a_stage_that_just_woke_is_over_the_time_since_its_first_arrival() -> None:
    m = StageMetrics(window_s=10.0)
    assert m.recent_rate(0.0) == (0.0, 0, 0.0)
    for k in range(29):  # 140 req/s for 0.2 s after a long idle
        m.on_arrival(100.0 + k / 140, 0)
    rate, n, span = m.recent_rate(100.0 + 28 / 140)
    assert (n, span) == (29, pytest.approx(0.2))
    assert rate == pytest.approx(140.0)  # not 29/s: the 28 gaps after the first arrival over 0.2 s
    for k in range(29, 300):
        m.on_arrival(100.0 + k / 140, 0)
    rate, n, span = m.recent_rate(100.0 + 299 / 140)
    assert span > 1.0 and rate == pytest.approx(n / 1.0) and n == pytest.approx(140, abs=1)
    m.on_arrival(150.0, 0)  # idle longer than the window: traffic begins again
    assert m.active_since == 150.0 and m.recent_rate(150.0) == (0.0, 1, 0.0)
