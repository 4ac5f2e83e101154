"""The live setup's costs outside emulated compute, from router records (`quart_tools.bench.hop_costs`)."""

from __future__ import annotations

import json

import pytest
from quart_tools.bench.hop_costs import (
    calls_in_flight,
    costs_of,
    decompose,
    dispatch_gaps,
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
    assert out["dispatch_ms"] == 0.0 and out["dispatch_calls"] == 0  # no call ever waited for a busy replica


def _visit(replica: str, wait: float, service: float) -> dict:
    return {"stage": 0, "replica": replica, "wait_ms": wait, "service_ms": service, "compute_ms": service}


def test_dispatch_gaps_read_a_freed_replicas_idle_time_before_its_waiting_call() -> None:
    recs = [{"arrival": 0.0, "stages": [_visit("a", 0.0, 10.0)]},
            {"arrival": 0.002, "stages": [_visit("a", 11.0, 10.0)]},  # waited from 2 ms; starts 3 ms after a freed
            {"arrival": 0.004, "stages": [_visit("b", 0.0, 10.0)]},  # another replica, alone: no gap
            {"arrival": 0.1, "stages": [_visit("a", 0.5, 10.0)]}]  # found a idle: not a back-to-back call
    assert dispatch_gaps(recs) == pytest.approx([0.003])
    late = [recs[0], {"arrival": 0.002, "stages": [_visit("a", 7.0, 10.0)]}]  # placed 1 ms before a's end: 0
    assert list(dispatch_gaps(late)) == [0.0]
    ok = [{**r, "status": 200, "latency_ms": r["stages"][0]["wait_ms"] + 10.0} for r in recs]
    out = decompose(ok, [r["latency_ms"] for r in ok], stages=1, nominal_ms=10.0)
    assert out["dispatch_ms"] == pytest.approx(3.0) and out["dispatch_calls"] == 1
    assert sim_terms({**out, "entry_ms": 0.0}, stages=1)["dispatch_s"] == pytest.approx(0.003)


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
    t = sim_terms({**costs, "hold_at_one_ms": -1.6, "hold_per_call_ms": 1.1}, stages=8)
    assert t["hop_s"] + t["hop_per_call_s"] == 0.0  # a line fitted on many calls in flight: never below 0 at one


def test_a_measurement_written_to_a_calibration_file_reads_back_with_its_sources(tmp_path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(Calibration().to_json()))
    loaded = {"compute_factor": 1.07, "stage_hold_ms": 3.8, "stage_gap_ms": 0.26, "entry_ms": 3.0, "service_cv": 0.19,
              "hold_at_one_ms": 3.1, "hold_per_call_ms": 0.3, "dispatch_ms": 2.5}
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


def test_the_simulators_dispatch_delays_only_a_call_a_freed_replica_takes_from_its_queue() -> None:
    from argparse import Namespace

    import numpy as np
    from quart_tools.arrivals import Arrivals
    from quart_tools.sim.validate import simulate

    args = Namespace(hosts=1, gpus_per_host=8, stage_ms=10.0, stages=1, replicas=1, max_replicas=1, seed=0,
                     policy="static")
    # two requests at once on one replica (the second waits), then one alone
    arrivals = Arrivals(np.array([0.0, 0.0, 5.0]), np.array([64, 64, 64]))
    base = simulate(args, arrivals, 0.0, service_cv=0.0)["series"]["latency_ms"]
    lagged = simulate(args, arrivals, 0.0, service_cv=0.0, dispatch_s=0.004)["series"]["latency_ms"]
    assert base == pytest.approx([10.0, 20.0, 10.0])
    assert lagged == pytest.approx([10.0, 24.0, 10.0])  # the waiting call starts 4 ms after the replica frees
