"""Arrival schedules: rate and CV on target, seeds repeat, trace replay scales time."""

from __future__ import annotations

import numpy as np
import pytest
from quart_tools.arrivals import (
    DEFAULT_TRACE,
    Trace,
    gamma_arrivals,
    interarrival_cv,
    load_trace,
    make_arrivals,
    pick_window,
    poisson_arrivals,
    replay_trace,
    trace_window,
)


@pytest.mark.parametrize("cv", [0.1, 1.0, 2.0, 4.0])
def test_gamma_rate_and_cv(cv: float) -> None:
    arr = gamma_arrivals(rate=200.0, cv=cv, duration_s=600.0, seed=3)
    assert arr.times[0] == 0.0 and np.all(np.diff(arr.times) >= 0) and arr.times[-1] < 600.0
    assert arr.rate() == pytest.approx(200.0, rel=0.1 if cv < 4 else 0.25)
    assert arr.cv() == pytest.approx(cv, rel=0.1 if cv < 4 else 0.2)


def test_poisson_is_cv_one_and_seeded() -> None:
    a = poisson_arrivals(500.0, 60.0, seed=1)
    b = poisson_arrivals(500.0, 60.0, seed=1)
    c = poisson_arrivals(500.0, 60.0, seed=2)
    assert np.array_equal(a.times, b.times)
    assert not np.array_equal(a.times[:100], c.times[:100])
    assert a.cv() == pytest.approx(1.0, abs=0.05)
    assert len(a) == pytest.approx(30000, rel=0.05)
    assert set(a.sizes.tolist()) == {1024}


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="rate"):
        gamma_arrivals(0.0, 1.0, 10.0)
    with pytest.raises(ValueError, match="cv"):
        gamma_arrivals(1.0, -1.0, 10.0)
    with pytest.raises(ValueError, match="unknown arrival kind"):
        make_arrivals("uniform", 1.0, 10.0)


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason="shared trace not present")
def test_trace_replay_rate_scaling_and_sizes() -> None:
    trace = load_trace()
    assert len(trace.offsets_s) > 8000
    assert interarrival_cv(trace.offsets_s) > 5  # the trace is bursty (CV ≈ 13)
    real = replay_trace(trace)
    fast = replay_trace(trace, speedup=10.0)
    assert fast.duration_s == pytest.approx(real.duration_s / 10.0)
    assert fast.cv() == pytest.approx(real.cv(), rel=1e-9)  # compression keeps the shape
    scaled = replay_trace(trace, target_rate=40.0, duration_s=300.0, loop=True)
    assert scaled.rate() == pytest.approx(40.0, rel=0.15)
    assert scaled.duration_s < 300.0
    assert np.array_equal(scaled.sizes, scaled.tokens * 4)
    with pytest.raises(ValueError, match="not both"):
        replay_trace(trace, speedup=2.0, target_rate=3.0)


def test_trace_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="--trace"):
        load_trace(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,x\n")
    with pytest.raises(ValueError, match="line 2"):
        load_trace(bad)


def _bursty_trace() -> Trace:
    """10 minutes: 1 req/s, then a 2-minute pause, then 5 req/s (a rate step), then 1 req/s."""
    parts = [np.arange(0, 180, 1.0), np.arange(300, 420, 0.2), np.arange(420, 600, 1.0)]
    t = np.concatenate(parts)
    return Trace(offsets_s=t, context_tokens=np.full(len(t), 100), generated_tokens=np.full(len(t), 10))


def test_trace_windows_are_picked_by_their_kind() -> None:
    trace = _bursty_trace()
    assert pick_window(trace, "busy", 120.0, step_s=60.0) == 300.0  # the 5 req/s minutes
    assert pick_window(trace, "quiet", 120.0, step_s=60.0, min_requests=30) in (120.0, 180.0)  # half in the pause
    step = pick_window(trace, "step", 120.0, step_s=60.0, min_requests=30)
    assert step in (120.0, 240.0)  # one half empty (the pause), the other at 1 or 5 req/s
    with pytest.raises(ValueError, match="unknown trace window"):
        pick_window(trace, "loud", 120.0)
    with pytest.raises(ValueError, match="does not fit"):
        pick_window(trace, "busy", 1e6)


@pytest.mark.parametrize("target", [0.5, 2.0, 23.7])  # thinning, replication, a fractional copy count
def test_trace_window_keeps_its_time_scale_and_matches_the_rate(target: float) -> None:
    trace = _bursty_trace()
    a = trace_window(trace, 240.0, 240.0, target, seed=4)
    assert a.kind == "trace" and len(a) == len(a.tokens)
    assert a.times.min() >= 0 and a.times.max() < 240.0 and np.all(np.diff(a.times) >= 0)
    assert len(a) / 240.0 == pytest.approx(target, rel=0.15)
    # real time: the pause (trace 240–300 s) stays a pause, the 5 req/s minutes stay 5× the 1 req/s ones
    assert np.sum(a.times < 60.0) <= max(1, 0.01 * len(a))
    dense, sparse = np.sum((a.times >= 60) & (a.times < 180)), np.sum(a.times >= 180)
    assert dense / 120.0 == pytest.approx(5 * sparse / 60.0, rel=0.35 if len(a) > 400 else 0.8)
    again = trace_window(trace, 240.0, 240.0, target, seed=4)
    assert np.array_equal(a.times, again.times)  # seeded


def test_trace_window_caps_the_busiest_minute() -> None:
    trace = _bursty_trace()
    a = trace_window(trace, 240.0, 240.0, 20.0, seed=1, peak_rate=30.0)
    peak = np.bincount((a.times // 60).astype(int)).max() / 60.0
    assert peak <= 30.0 * 1.1 and len(a) / 240.0 < 20.0  # the mean gives way to the cap
