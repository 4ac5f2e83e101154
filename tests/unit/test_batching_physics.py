"""The bench's physics (quart_tools.bench.batching_physics): the rates a compute profile allows within an SLO."""

from __future__ import annotations

import time

import pytest
from quart_tools.bench.batching_physics import CpuMeter, gain, machine_ceiling, theory


def _profile(fixed_ms: float, per_ms: float) -> list[dict]:
    # stage 0 cheap, stage 1 the bottleneck: S(b) = F + P·b
    return [{"size": b, "mixed_ms": [0.5, fixed_ms + per_ms * b]} for b in (1, 2, 4, 8, 16)]


def test_theory_counts_the_batches_that_fit_the_slo() -> None:
    t = theory(_profile(10.0, 10.0), "mixed_ms", slo_ms=100.0, unloaded_ms=25.0, batch_max=16)
    assert t["stage"] == 1 and t["fixed_ms"] == pytest.approx(10) and t["per_request_ms"] == pytest.approx(10)
    # 2·(10 + 10 b) + (25 − 20) ≤ 100 → b ≤ 3.75 → 3: 3 / 40 ms = 75 req/s against 1 / 20 ms = 50
    assert t["batch_within_slo"] == 3 and t["max_rate_off"] == 50 and t["max_rate_on"] == 75
    assert t["ratio"] == 1.5 and t["ratio_at_any_batch"] == 2.0
    # a GPU-like profile (F ≫ P) and a lax SLO: the full batch fits
    g = theory(_profile(20.0, 1.0), "mixed_ms", slo_ms=500.0, unloaded_ms=25.0, batch_max=16)
    assert g["batch_within_slo"] == 16 and g["ratio"] == pytest.approx(16 * 21 / 36, abs=0.01)


def test_cpu_meter_counts_this_process() -> None:
    meter = CpuMeter()
    meter.start()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:  # past psutil's 10 ms clock ticks, however busy the machine
        sum(i * i for i in range(10_000))
    cost = meter.per_request_ms(10)
    assert cost["gateway_client"] > 0 and cost["stages"] >= 0


def test_gain_is_the_same_requests_alone_over_batched_within_the_slo() -> None:
    # alone: 10 ms a request; batched: 6 + 4·b (stage 1 the slowest)
    profile = [{"size": b, "mixed_ms": [0.5, 6.0 + 4.0 * b], "alone_ms": [0.4 * b, 10.0 * b]} for b in (1, 2, 4, 8, 16)]
    g = gain(profile, "mixed_ms", "alone_ms", slo_ms=60.0, unloaded_ms=12.0)
    assert g["stage"] == 1 and g["by_size"][1] == 1.0 and g["by_size"][16] == pytest.approx(160 / 70, abs=0.01)
    # 2·S(b) + (12 − 10) ≤ 60 → S(b) ≤ 29 → b = 4 (22 ms) fits, 8 (38 ms) does not
    assert g["batch_within_slo"] == 4 and g["ratio_within_slo"] == pytest.approx(40 / 22, abs=0.01)
    assert g["ratio_at_largest"] == g["by_size"][16]


def test_machine_ceiling_is_the_cores_over_a_requests_cpu() -> None:
    rows = [{"batching": "off", "rate": 200, "cpu_ms_per_request": {"gateway_client": 2.0, "stages": 12.0}},
            {"batching": "on", "rate": 100, "cpu_ms_per_request": {"gateway_client": 2.0, "stages": 12.0}},
            {"batching": "on", "rate": 200, "cpu_ms_per_request": {"gateway_client": 2.0, "stages": 8.0}}]
    m = machine_ceiling(rows, cpus=2, rate_off=100.0)
    # the busiest batched row: 10 ms of CPU a request on 2 cores → 200 req/s, 2× the 100 reached off
    assert m["rate"] == 200 and m["cpu_ms_per_request"] == 10.0 and m["ceiling_rate"] == 200.0
    assert m["ceiling_over_off"] == 2.0 and m["cpu_ms_stages"] == 8.0
    assert machine_ceiling(rows[:1], cpus=2, rate_off=100.0) == {}


def test_the_bench_states_the_bound_its_own_figures_set() -> None:
    from quart_tools.bench.batching import physics

    profile = [{"size": b, "mixed_ms": [0.5, 6.0 + 4.0 * b], "uniform_ms": [0.5, 6.0 + 4.0 * b],
                "alone_ms": [0.4 * b, 10.0 * b], "transformers_ms": [8.0 + 5.0 * b],
                "transformers_alone_ms": [13.0 * b]} for b in (1, 2, 4, 8, 16)]
    rows = [{"batching": "on", "rate": 1, "cpu_ms_per_request": {"gateway_client": 20.0, "stages": 30.0}},
            {"batching": "on", "rate": 150, "cpu_ms_per_request": {"gateway_client": 2.0, "stages": 9.0}}]
    oneshot = {"profile": profile, "slo_ms": 60.0, "unloaded_ms": 12.0}
    t = physics(oneshot, rows, off=100.0, batch_max=16, cpus=2)
    assert t["gain_ours"]["ratio_within_slo"] == pytest.approx(1.82, abs=0.01)
    assert t["gain_transformers"]["batch_within_slo"] == 4 and t["gain_transformers"]["ratio_at_largest"] > 2
    # the fit allows 4 / 22 ms against 1 / 10 ms = 1.82; the machine 2 cores / 11 ms = 181.8 req/s = 1.82 × off
    assert t["bound"]["limits"] == {"fit_within_slo": t["mixed"]["ratio"], "measured_gain_within_slo": 1.82,
                                    "machine_cpu": 1.82}
    assert t["bound"]["ratio"] == min(t["bound"]["limits"].values())
    # off within the SLO only at the idle step: the machine's ceiling over it bounds nothing
    assert "machine_cpu" not in physics(oneshot, rows, off=1.0, batch_max=16, cpus=2)["bound"]["limits"]


def test_the_fit_takes_one_request_of_the_mix_alone_on_average() -> None:
    # the mix's first request is long (20 ms alone); its 16 requests average 10 ms alone
    profile = _profile(10.0, 10.0)
    for r in profile:
        r["alone_ms"] = [0.5, 10.0 * r["size"]]
    t = theory(profile, "mixed_ms", slo_ms=1000.0, unloaded_ms=25.0, batch_max=16)
    assert t["max_rate_off"] == 100.0  # 1 / 10 ms, not 1 / 20 ms
