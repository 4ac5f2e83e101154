"""Sliding-window stage metrics: rates, CV, waits, trimming, JSONL records, prometheus export."""

from __future__ import annotations

import io
import json
import random
import statistics

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


class Reference:
    """The statistics, recomputed exactly from every event kept in the window (the pre-running-sum code)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.arrivals: list[float] = []
        self.waits: list[tuple[float, float]] = []
        self.services: list[tuple[float, float]] = []
        self.acts: list[tuple[float, float]] = []

    def _in(self, rows: list, now: float) -> list:
        # Oldest-first trimming, as the live deques do (an old entry behind a newer one stays).
        cutoff, k = now - self.window_s, 0
        while k < len(rows) and (rows[k] if isinstance(rows[k], float) else rows[k][0]) < cutoff:
            k += 1
        del rows[:k]
        return rows

    def stats(self, now: float) -> dict:
        a, w, s, b = (self._in(x, now) for x in (self.arrivals, self.waits, self.services, self.acts))
        gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
        return {
            "arrival_rate": len(a) / self.window_s,
            "recent": sum(1 for t in a if t >= now - 1.0) / 1.0,
            "mean_wait_s": statistics.fmean(x for _, x in w) if w else 0.0,
            "busy_s": sum(x for _, x in s),
            "mean_service_s": statistics.fmean(x for _, x in s) if s else None,
            "mean_activation_bytes": statistics.fmean(x for _, x in b) if b else 0.0,
            "cv_arrival": (statistics.pstdev(gaps) / statistics.fmean(gaps)) if len(a) >= 3 else 1.0,
        }


@pytest.mark.parametrize("trim_on_event", [True, False])  # live router / simulator
def test_running_sums_agree_with_exact_statistics(trim_on_event: bool) -> None:
    """Router-style events (a wait is reported at completion with its earlier dispatch time), bursts
    and idle gaps, 20 window lengths long: every statistic equals the exact recomputation."""
    rng = random.Random(5)
    fast, ref = StageMetrics(10.0, trim_on_event=trim_on_event), Reference(10.0)
    t, checks = 0.0, 0
    for i in range(20_000):
        t += rng.expovariate(100.0) if (i // 2000) % 2 == 0 else rng.expovariate(5.0) * (3 if i % 97 == 0 else 1)
        size = 100 + i % 13
        fast.on_arrival(t, size)
        ref.arrivals.append(t)
        ref.acts.append((t, size))
        start, service = t - 0.003 * (i % 5), 0.01 + 0.002 * (i % 7)
        fast.on_dispatch(start, 0.004 * (i % 9))  # out of time order, as the router reports it
        fast.on_complete(t, service)
        ref.waits.append((start, 0.004 * (i % 9)))
        ref.services.append((t, service))
        if i % 250 == 0:
            exp = ref.stats(t)
            assert fast.arrival_rate(t) == exp["arrival_rate"]
            assert fast.arrival_rate(t, 1.0) == exp["recent"]
            assert fast.arrival_rate(t, 0.5) == sum(1 for x in ref.arrivals if x >= t - 0.5) / 0.5
            for name in ("mean_wait_s", "busy_s", "mean_activation_bytes", "cv_arrival"):
                assert getattr(fast, name)(t) == pytest.approx(exp[name], rel=1e-9, abs=1e-12), name
            if exp["mean_service_s"] is not None:
                assert fast.mean_service_s(t) == pytest.approx(exp["mean_service_s"], rel=1e-9)
            checks += 1
    assert checks == 80 and fast.total_arrivals == fast.total_completions == 20_000
    assert len(fast.arrivals) < 2_000  # bounded by the window, whichever path trims


def test_live_and_simulated_snapshots_agree() -> None:
    """The router's path (trim on every event) and the simulator's (trim on read) build the same snapshot."""
    from gateway_plugin.snapshot_builder import StageState, build_snapshot

    class Platform:
        def pipelines(self):
            return {"m": ["m-0", "m-1"]}

        def stage_state(self, fn):
            return StageState(ready=2, desired=3, param_bytes=7, profiled_service_s=0.02)

        def queue_len(self, fn):
            return 4

        def busy(self, fn):
            return 1

    live, sim = MetricsCollector(5.0), MetricsCollector(5.0)
    sim.stages.update({fn: StageMetrics(5.0, trim_on_event=False) for fn in ("m-0", "m-1")})
    rng, t = random.Random(9), 0.0
    for i in range(3000):
        t += rng.expovariate(60.0)
        for c in (live, sim):
            for k, fn in enumerate(("m-0", "m-1")):
                c.stage(fn).on_arrival(t, 10 * k + i % 4)
                c.stage(fn).on_dispatch(t - 0.001, 0.001 * (i % 3))
                c.stage(fn).on_complete(t, 0.015 + 0.001 * k)
    a = build_snapshot(t, "m", ["m-0", "m-1"], Platform(), Platform(), live, 2.0)
    b = build_snapshot(t, "m", ["m-0", "m-1"], Platform(), Platform(), sim, 2.0)
    for sa, sb in zip(a.stages, b.stages, strict=True):
        for field in ("arrival_rate", "arrival_rate_recent", "service_rate", "mean_wait_s", "cv_arrival",
                      "utilisation", "activation_bytes"):
            assert getattr(sa, field) == pytest.approx(getattr(sb, field), rel=1e-9), field
    assert a.slo_s == b.slo_s == pytest.approx(2.0 * 0.04)
