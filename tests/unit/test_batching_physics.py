"""The bench's physics (quart_tools.bench.batching_physics): the rates a compute profile allows within an SLO."""

from __future__ import annotations

import pytest
from quart_tools.bench.batching_physics import CpuMeter, theory


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
    sum(i * i for i in range(300_000))
    cost = meter.per_request_ms(10)
    assert cost["gateway_client"] > 0 and cost["stages"] >= 0
