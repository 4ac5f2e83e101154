"""Sliding-window stage metrics: rates, CV, waits, trimming, JSONL records, prometheus export."""

from __future__ import annotations

import io
import json
import random

import pytest
from gateway_plugin.metrics import MetricsCollector, RequestRecord, StageMetrics, StageVisit


def test_rates_waits_and_window_trimming() -> None:
    m = StageMetrics(window_s=10.0)
    for k in range(50):  # 5 req/s for 10 s
        t = k * 0.2
        m.on_arrival(t, 1000)
        m.on_dispatch(t, 0.1)
        m.on_complete(t + 0.05, 0.25)
    now = 9.9
    assert m.arrival_rate(now) == pytest.approx(5.0, rel=0.05)
    assert m.mean_service_s(now) == pytest.approx(0.25)
    assert m.mean_wait_s(now) == pytest.approx(0.1)
    assert m.cv_arrival(now) == pytest.approx(0.0, abs=1e-6)  # perfectly regular
    assert m.arrival_rate(now, 1.0) == pytest.approx(5.0, rel=0.25)
    assert m.mean_activation_bytes(now) == 1000
    later = 30.0  # everything left the window: rates drop, the last service time is remembered
    assert m.arrival_rate(later) == 0.0 and m.mean_wait_s(later) == 0.0
    assert m.mean_service_s(later) == pytest.approx(0.25)
    assert m.total_arrivals == 50


def test_cv_of_poisson_is_about_one_and_bursts_raise_it() -> None:
    rng = random.Random(3)
    poisson, t = StageMetrics(window_s=1e9), 0.0
    for _ in range(4000):
        t += rng.expovariate(10.0)
        poisson.on_arrival(t, 0)
    assert poisson.cv_arrival(t) == pytest.approx(1.0, abs=0.08)
    bursty, t = StageMetrics(window_s=1e9), 0.0
    for _ in range(200):
        t += 5.0
        for _ in range(20):
            t += 0.001
            bursty.on_arrival(t, 0)
    assert bursty.cv_arrival(t) > 3.0


def test_records_are_jsonl_and_counted_in_prometheus() -> None:
    sink = io.StringIO()
    c = MetricsCollector(10.0, records=sink)
    c.record(RequestRecord("r1", "m", 1.0, 1.5, 200, 500.0, [StageVisit(0, "m-stage-0", 1.0, 2.0)]))
    c.record(RequestRecord("r2", "m", 1.0, 1.2, 504, 200.0, error="deadline"))
    rows = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert rows[0]["stages"][0]["service_ms"] == 2.0 and rows[1]["status"] == 504
    text = c.prometheus_text().decode()
    assert 'quart_pipeline_requests_total{code="200",model="m"} 1.0' in text
