"""Scheduler metrics in live use: cache hit rate of scale-ups, replica-ready time by source, GPU and
memory per host. A pure accumulator (no I/O, no clock: callers pass what they measured) that the
gateway feeds and exports through prometheus_client; the benchmark reads `snapshot()`.

    metrics = SchedulerMetrics()
    metrics.record_schedule(result)                                # after each placer call
    metrics.record_replica(function, host, info.source, info.ready_ms, key=True)   # per started replica
    metrics.record_hosts(views)                                    # after each KeysManager report
    registry.register(SchedulerCollector(metrics))                 # /metrics
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
from quart_kernel.scheduling.types import HostView, ScheduleResult

READY_BUCKETS_MS: tuple[float, ...] = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
_HITS = ("fork", "gpu")  # sources that used a cache (host memory or a resident copy)


@dataclass(frozen=True, slots=True)
class ReadyStats:
    """Replica-ready times of one start source, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    max_ms: float


@dataclass(frozen=True, slots=True)
class HostUsage:
    name: str
    gpu_slots: int
    gpu_used: int
    memory_limit: int
    memory_used: int


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Everything the accumulator knows, at one instant."""

    scale_ups: int
    hits: int
    key_scale_ups: int
    key_hits: int
    ready: dict[str, ReadyStats] = field(default_factory=dict)  # by source: fork | cold | gpu
    hosts: tuple[HostUsage, ...] = ()
    schedules: int = 0
    dispersed: int = 0
    unplaced: int = 0
    last_contention: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.scale_ups if self.scale_ups else 0.0

    @property
    def key_hit_rate(self) -> float:
        return self.key_hits / self.key_scale_ups if self.key_scale_ups else 0.0

    @property
    def mean_ready_ms(self) -> float:
        total = sum(s.count for s in self.ready.values())
        return sum(s.mean_ms * s.count for s in self.ready.values()) / total if total else 0.0

    def to_dict(self) -> dict:
        return {
            "scale_ups": self.scale_ups,
            "hit_rate": self.hit_rate,
            "key_scale_ups": self.key_scale_ups,
            "key_hit_rate": self.key_hit_rate,
            "mean_ready_ms": self.mean_ready_ms,
            "ready_by_source": {k: _slots_dict(v) for k, v in self.ready.items()},
            "hosts": [_slots_dict(h) for h in self.hosts],
            "schedules": self.schedules,
            "dispersed": self.dispersed,
            "unplaced": self.unplaced,
        }


def _slots_dict(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}


class _SourceTimes:
    def __init__(self, window: int) -> None:
        self.count = 0
        self.sum_ms = 0.0
        self.buckets = [0] * len(READY_BUCKETS_MS)
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, ms: float) -> None:
        self.count += 1
        self.sum_ms += ms
        self.recent.append(ms)
        for i, bound in enumerate(READY_BUCKETS_MS):
            if ms <= bound:
                self.buckets[i] += 1

    def stats(self) -> ReadyStats:
        arr = np.fromiter(self.recent, dtype=float)
        if arr.size == 0:
            return ReadyStats(self.count, 0.0, 0.0, 0.0, 0.0)
        p50, p95 = np.percentile(arr, [50, 95])
        return ReadyStats(self.count, self.sum_ms / self.count, float(p50), float(p95), float(arr.max()))


class SchedulerMetrics:
    """Thread-safe accumulator; quantiles over the last `window` samples of each source."""

    def __init__(self, window: int = 4096) -> None:
        self._lock = threading.Lock()
        self._window = window
        self._by_source_key: dict[tuple[str, bool], int] = {}
        self._times: dict[str, _SourceTimes] = {}
        self._hosts: dict[str, HostUsage] = {}
        self._schedules = self._dispersed = self._unplaced = 0
        self._last_contention = 0.0

    def record_schedule(self, result: ScheduleResult) -> None:
        """One placer decision (before the replicas start)."""
        with self._lock:
            self._schedules += 1
            self._dispersed += int(result.dispersed)
            self._unplaced += sum(u.count for u in result.unplaced)
            self._last_contention = result.contention if np.isfinite(result.contention) else -1.0

    def record_replica(self, function: str, host: str, source: str, ready_ms: float | None, key: bool = False) -> None:
        """One scale-up replica as its KeysManager started it (`source` from its ReplicaInfo)."""
        with self._lock:
            k = (source, bool(key))
            self._by_source_key[k] = self._by_source_key.get(k, 0) + 1
            if ready_ms is not None:
                self._times.setdefault(source, _SourceTimes(self._window)).add(float(ready_ms))

    def record_hosts(self, hosts: Iterable[HostView]) -> None:
        """GPU and memory use per host, from the latest reports."""
        with self._lock:
            for h in hosts:
                self._hosts[h.name] = HostUsage(h.name, h.gpu_slots, h.gpu_used, h.memory_limit, h.memory_used)

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            counts = dict(self._by_source_key)
            return MetricsSnapshot(
                scale_ups=sum(counts.values()),
                hits=sum(n for (src, _), n in counts.items() if src in _HITS),
                key_scale_ups=sum(n for (_, key), n in counts.items() if key),
                key_hits=sum(n for (src, key), n in counts.items() if key and src in _HITS),
                ready={src: t.stats() for src, t in sorted(self._times.items())},
                hosts=tuple(self._hosts[name] for name in sorted(self._hosts)),
                schedules=self._schedules,
                dispersed=self._dispersed,
                unplaced=self._unplaced,
                last_contention=self._last_contention,
            )

    def _export(self):
        with self._lock:
            return (
                dict(self._by_source_key),
                {s: (t.count, t.sum_ms, list(t.buckets)) for s, t in self._times.items()},
                list(self._hosts.values()),
                (self._schedules, self._dispersed, self._unplaced, self._last_contention),
            )


class SchedulerCollector:
    """prometheus_client custom collector over a SchedulerMetrics: `registry.register(SchedulerCollector(m))`."""

    def __init__(self, metrics: SchedulerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        by_source_key, times, hosts, (schedules, dispersed, unplaced, contention) = self.metrics._export()
        ups = CounterMetricFamily(
            "quart_scheduler_scale_ups", "Replicas started for scale-ups, by start source and key stage", labels=["source", "key"]
        )
        for (source, key), n in sorted(by_source_key.items()):
            ups.add_metric([source, str(key).lower()], n)
        yield ups
        snap = self.metrics.snapshot()
        hit = GaugeMetricFamily("quart_scheduler_cache_hit_ratio", "Scale-ups that forked from a cache", labels=["stages"])
        hit.add_metric(["all"], snap.hit_rate)
        hit.add_metric(["key"], snap.key_hit_rate)
        yield hit
        ready = HistogramMetricFamily(
            "quart_scheduler_replica_ready_ms", "Start request to healthy replica, milliseconds", labels=["source"]
        )
        for source, (count, total, buckets) in sorted(times.items()):
            cum = [(str(float(b)), n) for b, n in zip(READY_BUCKETS_MS, buckets, strict=True)] + [("+Inf", count)]
            ready.add_metric([source], cum, total)
        yield ready
        for metric, help_, attr in (
            ("quart_host_gpu_slots", "GPU slots of the host", "gpu_slots"),
            ("quart_host_gpu_used", "GPU slots in use", "gpu_used"),
            ("quart_host_memory_limit_bytes", "Memory the host's KeysManager may use for parameters", "memory_limit"),
            ("quart_host_memory_used_bytes", "Parameter memory in use", "memory_used"),
        ):
            family = GaugeMetricFamily(metric, help_, labels=["host"])
            for h in hosts:
                family.add_metric([h.name], getattr(h, attr))
            yield family
        yield CounterMetricFamily("quart_scheduler_schedules", "Placer decisions", value=schedules)
        yield CounterMetricFamily("quart_scheduler_dispersed", "Decisions placed by KL dispersion", value=dispersed)
        yield CounterMetricFamily("quart_scheduler_unplaced", "Replicas that found no host", value=unplaced)
        yield GaugeMetricFamily("quart_scheduler_contention", "Requested replicas / free slots of the last decision", value=contention)
