"""Pure helpers of `quartctl bench policies` (the live run itself is the benchmark, not a CI test)."""

from __future__ import annotations

import pytest
from quart_tools.arrivals import DEFAULT_TRACE
from quart_tools.bench.policies import compare, ready_lags, samples_from_timeline


def test_ready_lags_and_samples_from_timeline() -> None:
    rows = [
        {"time": 10.0, "replicas": [1, 1], "desired": [1, 1], "queue": [0, 0]},
        {"time": 11.0, "replicas": [1, 1], "desired": [3, 1], "queue": [5, 0]},
        {"time": 12.0, "replicas": [2, 1], "desired": [3, 1], "queue": [2, 1]},
        {"time": 13.5, "replicas": [3, 1], "desired": [3, 1], "queue": [0, 0]},
    ]
    assert ready_lags(rows) == [2.5]
    withdrawn = [  # asked for 3, then 1 again before the third replica was ready: no sample
        {"time": 0.0, "replicas": [1], "desired": [1], "queue": [0]},
        {"time": 1.0, "replicas": [1], "desired": [3], "queue": [4]},
        {"time": 2.0, "replicas": [2], "desired": [1], "queue": [0]},
        {"time": 30.0, "replicas": [1], "desired": [3], "queue": [4]},
        {"time": 31.0, "replicas": [3], "desired": [3], "queue": [0]},
    ]
    assert ready_lags(withdrawn) == [1.0]
    samples = samples_from_timeline(rows, 10.0)
    assert samples[2] == {"t": 1.0, "stage": 0, "replicas": 1, "queue": 5} and len(samples) == 8


def test_compare_against_the_best_baseline() -> None:
    def entry(policy, mean, slo, rs):
        return {"policy": policy, "mean_ms": mean, "slo_attainment": {"1.5": slo}, "replica_seconds": rs}

    c = compare([entry("quart", 300, 0.6, 100), entry("static", 1000, 0.3, 200), entry("inferline", 600, 0.4, 120)])
    assert c["best_mean_baseline"] == "inferline" and c["mean_ratio"] == 0.5
    assert c["best_slo_baseline"] == "inferline" and abs(c["slo15_ratio"] - 1.5) < 1e-9 and c["target_met"]
    assert not compare([entry("quart", 500, 0.6, 100), entry("static", 600, 0.5, 90)])["target_met"]
    # an oracle without queueing is as fast as the idle pipeline: 160 ms ÷ 200 ms → the 0.6× target is out of reach
    bound = compare([entry("quart", 250, 0.6, 100), entry("static", 200, 0.8, 90)], profiled_ms=160.0)
    assert bound["best_possible_mean_ratio"] == 0.8 and bound["best_possible_slo15_ratio"] == 1.25


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason="shared trace not present")
def test_trace_window_has_the_target_rate_and_the_traces_burstiness() -> None:
    import numpy as np
    from quart_tools.bench.policies import trace_window

    arrivals = trace_window(20.0, 20.0)
    assert len(arrivals.times) == 400 and arrivals.times[-1] < 20.0
    gaps = np.diff(arrivals.times)
    assert gaps.std() / gaps.mean() > 4  # the real trace's bursts, not a smoothed rate
