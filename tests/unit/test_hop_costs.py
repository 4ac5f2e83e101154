"""The live setup's costs outside emulated compute, from router records (`quart_tools.bench.hop_costs`)."""

from __future__ import annotations

import json

import pytest
from quart_tools.bench.hop_costs import costs_of, decompose, nominal_stage_ms, sim_terms, update_calibration
from quart_tools.sim.calibration import Calibration


def _record(stages: int, compute: float, hold: float, gap: float, wait: float = 0.0, status: int = 200) -> dict:
    visits = [{"stage": i, "wait_ms": wait, "service_ms": compute + hold, "compute_ms": compute} for i in range(stages)]
    return {"status": status, "latency_ms": stages * (compute + hold + wait + gap), "stages": visits}


def test_decompose_splits_latency_into_compute_hold_gap_and_entry() -> None:
    recs = [_record(4, 10.0, 2.0, 0.5, wait=0.25), _record(4, 12.0, 2.0, 0.5, wait=0.25)]
    out = decompose(recs, [60.0, 68.0], stages=4, nominal_ms=10.0)
    assert out["requests"] == 2
    assert out["compute_factor"] == pytest.approx(1.1)
    assert out["stage_hold_ms"] == pytest.approx(2.0)
    assert out["stage_gap_ms"] == pytest.approx(0.75)  # the router's time between stages, waits included
    assert out["entry_ms"] == pytest.approx(64.0 - 4 * 13.75)
    assert out["service_cv"] == pytest.approx(1.0 / 13.0)


def test_decompose_skips_failures_and_refuses_when_nothing_succeeded() -> None:
    recs = [_record(2, 10.0, 1.0, 0.0), _record(2, 99.0, 1.0, 0.0, status=502), _record(1, 99.0, 1.0, 0.0)]
    assert decompose(recs, [23.0], stages=2, nominal_ms=10.0)["requests"] == 1
    with pytest.raises(ValueError, match="no successful"):
        decompose(recs[1:], [], stages=2, nominal_ms=10.0)


def test_sim_terms_give_the_round_trip_its_measured_mean_and_cv() -> None:
    costs = {"compute_factor": 1.05, "stage_hold_ms": 3.5, "stage_gap_ms": 0.25, "entry_ms": 4.0, "service_cv": 0.2}
    t = sim_terms(costs, stages=8)
    compute = nominal_stage_ms(8) * 1.05
    assert t["stage_ms"] == pytest.approx(compute) and t["hop_s"] == pytest.approx(0.0035)
    assert t["outside_s"] == pytest.approx((8 * 0.25 + 4.0) / 1000)
    # the simulator draws compute × Gamma(cv) + hold: its std is compute × cv = 0.2 × (compute + hold)
    assert t["service_cv"] * compute == pytest.approx(0.2 * (compute + 3.5))


def test_a_measurement_written_to_a_calibration_file_reads_back_with_its_sources(tmp_path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(Calibration().to_json()))
    loaded = {"compute_factor": 1.07, "stage_hold_ms": 3.8, "stage_gap_ms": 0.26, "entry_ms": 3.0, "service_cv": 0.19}
    update_calibration(path, loaded, "test run")
    cal = Calibration.load(path)
    assert costs_of(cal) == pytest.approx(loaded)
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
