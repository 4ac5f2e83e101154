"""The live setup's costs outside emulated compute, from router records (`quart_tools.bench.hop_costs`)."""

from __future__ import annotations

import json

import pytest
from quart_tools.bench.hop_costs import (
    calls_in_flight,
    costs_of,
    decompose,
    hold_fit,
    nominal_stage_ms,
    sim_terms,
    update_calibration,
)
from quart_tools.sim.calibration import Calibration


def _record(stages: int, compute: float, hold: float, gap: float, wait: float = 0.0, status: int = 200,
            arrival: float = 0.0) -> dict:
    visits = [{"stage": i, "wait_ms": wait, "service_ms": compute + hold, "compute_ms": compute} for i in range(stages)]
    return {"status": status, "arrival": arrival, "latency_ms": stages * (compute + hold + wait + gap), "stages": visits}


def test_decompose_splits_latency_into_compute_hold_gap_and_entry() -> None:
    recs = [_record(4, 10.0, 2.0, 0.5, wait=0.25), _record(4, 12.0, 2.0, 0.5, wait=0.25, arrival=10.0)]
    out = decompose(recs, [60.0, 68.0], stages=4, nominal_ms=10.0)
    assert out["requests"] == 2
    assert out["compute_factor"] == pytest.approx(1.1)
    assert out["stage_hold_ms"] == pytest.approx(2.0)
    assert out["stage_gap_ms"] == pytest.approx(0.5)  # the router's time between stages, waits apart
    assert out["wait_ms"] == pytest.approx(0.25)
    assert out["entry_ms"] == pytest.approx(64.0 - 4 * 13.75)
    assert out["service_cv"] == pytest.approx(1.0 / 13.0)
    assert out["calls_in_flight_mean"] == 1.0 and out["hold_per_call_ms"] == 0.0 and out["hold_at_one_ms"] == 2.0


def test_calls_in_flight_counts_the_calls_overlapping_each_one() -> None:
    recs = [_record(2, 10.0, 0.0, 0.0), _record(2, 10.0, 0.0, 0.0, arrival=0.005), _record(1, 10.0, 0.0, 0.0, arrival=1.0)]
    holds, calls = calls_in_flight(recs)
    # calls of 10 ms: [0, 10] and [10, 20] ms, then [5, 15] and [15, 25]; the last, at 1 s, alone. At each midpoint
    # (5, 15, 10, 20 ms) two calls are in flight, except at 20 ms, where the first request's second call just ended
    assert [int(c) for c in calls] == [2, 2, 2, 1, 1] and list(holds) == [0.0] * 5


def test_hold_fit_reads_the_growth_per_call_in_flight() -> None:
    import numpy as np

    calls = np.array([1, 2, 4, 8, 16])
    assert hold_fit(3.0 + 0.5 * (calls - 1), calls) == pytest.approx((3.0, 0.5))
    assert hold_fit(np.array([3.0, 3.0]), np.array([2, 2])) == (3.0, 0.0)  # nothing to fit: the mean
    assert hold_fit(9.0 - calls, calls)[1] == 0.0  # never a negative growth


def test_decompose_skips_failures_and_refuses_when_nothing_succeeded() -> None:
    recs = [_record(2, 10.0, 1.0, 0.0), _record(2, 99.0, 1.0, 0.0, status=502), _record(1, 99.0, 1.0, 0.0)]
    assert decompose(recs, [23.0], stages=2, nominal_ms=10.0)["requests"] == 1
    with pytest.raises(ValueError, match="no successful"):
        decompose(recs[1:], [], stages=2, nominal_ms=10.0)


def test_sim_terms_give_the_round_trip_its_measured_mean_and_cv() -> None:
    costs = {"compute_factor": 1.05, "stage_hold_ms": 3.5, "stage_gap_ms": 0.25, "entry_ms": 4.0, "service_cv": 0.2,
             "hold_at_one_ms": 3.5, "hold_per_call_ms": 0.0}
    t = sim_terms(costs, stages=8)
    assert t["hop_per_call_s"] == 0.0
    compute = nominal_stage_ms(8) * 1.05
    assert t["stage_ms"] == pytest.approx(compute) and t["hop_s"] == pytest.approx(0.0035)
    assert t["outside_s"] == pytest.approx((8 * 0.25 + 4.0) / 1000)
    # the simulator draws compute × Gamma(cv) + hold: its std is compute × cv = 0.2 × (compute + hold)
    assert t["service_cv"] * compute == pytest.approx(0.2 * (compute + 3.5))
    t = sim_terms({**costs, "hold_at_one_ms": 3.0, "hold_per_call_ms": 0.4}, stages=8)
    assert t["hop_s"] + t["hop_per_call_s"] == pytest.approx(0.003)  # the hold with one call in flight


def test_a_measurement_written_to_a_calibration_file_reads_back_with_its_sources(tmp_path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(Calibration().to_json()))
    loaded = {"compute_factor": 1.07, "stage_hold_ms": 3.8, "stage_gap_ms": 0.26, "entry_ms": 3.0, "service_cv": 0.19,
              "hold_at_one_ms": 3.1, "hold_per_call_ms": 0.3}
    update_calibration(path, loaded, "test run")
    cal = Calibration.load(path)
    assert costs_of(cal) == pytest.approx({**loaded, "stage_hold_ms": 3.1})
    assert "test run" in cal.sources["live_stage_hold_s"] and cal.hosts == Calibration().hosts


def test_the_simulators_outside_time_adds_to_every_latency_and_holds_no_replica() -> None:
    from argparse import Namespace

    from quart_tools.arrivals import poisson_arrivals
    from quart_tools.sim.validate import simulate

    args = Namespace(hosts=1, gpus_per_host=8, stage_ms=10.0, stages=4, replicas=1, max_replicas=1, seed=0,
                     policy="static")
    arrivals = poisson_arrivals(20.0, 10.0, seed=3)
    base = simulate(args, arrivals, 0.002)
    more = simulate(args, arrivals, 0.002, outside_s=0.005)
    a, b = base["series"]["latency_ms"], more["series"]["latency_ms"]
    assert len(a) == len(b) == len(arrivals)
    assert all(y - x == pytest.approx(5.0) for x, y in zip(a, b, strict=True))  # queueing unchanged
    assert more["replica_seconds"] == pytest.approx(base["replica_seconds"], rel=0.01)
