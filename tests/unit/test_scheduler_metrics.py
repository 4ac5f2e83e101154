"""Scheduler metrics accumulator and its Prometheus export."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from quart_kernel.scheduling import HostView, ReplicaRequest, make_placer
from quart_provider.scheduler_metrics import SchedulerCollector, SchedulerMetrics


def _fed() -> SchedulerMetrics:
    m = SchedulerMetrics()
    hosts = [HostView("a", 4, 1, 100, 40, frozenset({"s"})), HostView("b", 4, 4, 100, 90)]
    m.record_schedule(make_placer("cache-aware").place(hosts, [ReplicaRequest("s", 5, 10, key=True)]))
    m.record_replica("s", "a", "fork", 100.0, key=True)
    m.record_replica("s", "a", "fork", 300.0, key=True)
    m.record_replica("s", "a", "cold", 4000.0, key=True)
    m.record_replica("t", "b", "cold", 2000.0, key=False)
    m.record_replica("t", "b", "fork", None, key=False)  # no timing known: counted, not timed
    m.record_hosts(hosts)
    return m


def test_snapshot_hit_rates_and_ready_times():
    snap = _fed().snapshot()
    assert (snap.scale_ups, snap.hits, snap.key_scale_ups, snap.key_hits) == (5, 3, 3, 2)
    assert snap.hit_rate == pytest.approx(0.6)
    assert snap.key_hit_rate == pytest.approx(2 / 3)
    assert snap.ready["fork"].count == 2 and snap.ready["fork"].mean_ms == pytest.approx(200.0)
    assert snap.ready["cold"].mean_ms == pytest.approx(3000.0)
    assert snap.mean_ready_ms == pytest.approx((100 + 300 + 4000 + 2000) / 4)
    assert [h.name for h in snap.hosts] == ["a", "b"] and snap.hosts[1].gpu_used == 4
    assert snap.schedules == 1 and snap.unplaced == 2  # 3 free slots for 5 replicas
    d = snap.to_dict()
    assert d["ready_by_source"]["cold"]["count"] == 2 and d["hosts"][0]["memory_used"] == 40


def test_empty_snapshot():
    snap = SchedulerMetrics().snapshot()
    assert snap.hit_rate == 0.0 and snap.mean_ready_ms == 0.0 and snap.ready == {}


def test_prometheus_export():
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(_fed()))
    text = generate_latest(registry).decode()
    assert 'quart_scheduler_scale_ups_total{key="true",source="fork"} 2.0' in text
    assert 'quart_scheduler_cache_hit_ratio{stages="key"} 0.6666' in text
    assert 'quart_scheduler_replica_ready_ms_bucket{le="250.0",source="fork"} 1.0' in text
    assert 'quart_scheduler_replica_ready_ms_count{source="cold"} 2.0' in text
    assert 'quart_host_gpu_used{host="b"} 4.0' in text
    assert 'quart_host_memory_limit_bytes{host="a"} 100.0' in text
    assert "quart_scheduler_unplaced_total 2.0" in text
