"""Per-stage sliding-window metrics the router feeds and the controller reads; per-request records.

The router reports every event (arrival at a stage, dispatch to a replica, completion with the
stage's timing headers); ``StageMetrics`` keeps them for ``window_s`` seconds and answers λ_i, μ_i,
mean wait, CV_i of inter-arrival times, utilisation and mean activation bytes. Queue length and
busy counts are read live from the router. ``MetricsCollector`` exports everything on a private
prometheus registry (``/metrics``) and as JSON, and appends one JSON line per finished request
(arrival, per-stage wait and service, status) for CV-model training, CPU profiling and reports.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


@dataclass(slots=True)
class StageVisit:
    """One request's pass through one stage (a record field; times in ms)."""

    stage: int
    function: str
    wait_ms: float
    service_ms: float  # round trip to the replica
    compute_ms: float = 0.0  # X-Quart-Compute-Ms
    serde_ms: float = 0.0  # X-Quart-Deserialize-Ms + X-Quart-Serialize-Ms
    replica: str = ""
    attempts: int = 1
    queue_len: int = 0  # queue length the request found on arrival at the stage
    cpus: float = 1.0
    activation_bytes: int = 0
    param_bytes: int = 0


@dataclass(slots=True)
class RequestRecord:
    """One pipeline request, as written to the JSONL records file."""

    id: str
    model: str
    arrival: float  # seconds (the router's clock)
    end: float
    status: int
    latency_ms: float
    stages: list[StageVisit] = field(default_factory=list)
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


@dataclass(slots=True)
class StageMetrics:
    """Sliding windows of one stage. Times are the router's monotonic clock in seconds."""

    window_s: float
    arrivals: deque = field(default_factory=deque)  # arrival times
    waits: deque = field(default_factory=deque)  # (time, wait seconds)
    services: deque = field(default_factory=deque)  # (time, service seconds)
    activations: deque = field(default_factory=deque)  # (time, input bytes)
    total_arrivals: int = 0
    total_completions: int = 0
    last_service_s: float = 0.0  # most recent mean service time, kept when the window empties

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while self.arrivals and self.arrivals[0] < cutoff:
            self.arrivals.popleft()
        for dq in (self.waits, self.services, self.activations):
            while dq and dq[0][0] < cutoff:
                dq.popleft()

    def on_arrival(self, now: float, activation_bytes: int) -> None:
        self.arrivals.append(now)
        self.activations.append((now, activation_bytes))
        self.total_arrivals += 1
        self._trim(now)

    def on_dispatch(self, now: float, wait_s: float) -> None:
        self.waits.append((now, wait_s))
        self._trim(now)

    def on_complete(self, now: float, service_s: float) -> None:
        self.services.append((now, service_s))
        self.total_completions += 1
        self._trim(now)

    def arrival_rate(self, now: float, window_s: float | None = None) -> float:
        self._trim(now)
        w = self.window_s if window_s is None else window_s
        return sum(1 for t in self.arrivals if t >= now - w) / w

    def mean_service_s(self, now: float) -> float:
        self._trim(now)
        if self.services:
            self.last_service_s = statistics.fmean(s for _, s in self.services)
        return self.last_service_s

    def mean_wait_s(self, now: float) -> float:
        self._trim(now)
        return statistics.fmean(w for _, w in self.waits) if self.waits else 0.0

    def cv_arrival(self, now: float) -> float:
        """std / mean of inter-arrival times in the window; 1.0 (Poisson) with fewer than 3 arrivals."""
        self._trim(now)
        if len(self.arrivals) < 3:
            return 1.0
        gaps = [b - a for a, b in zip(self.arrivals, list(self.arrivals)[1:], strict=False)]
        mean = statistics.fmean(gaps)
        return statistics.pstdev(gaps) / mean if mean > 0 else 0.0

    def busy_s(self, now: float) -> float:
        self._trim(now)
        return sum(s for _, s in self.services)

    def mean_activation_bytes(self, now: float) -> float:
        self._trim(now)
        return statistics.fmean(b for _, b in self.activations) if self.activations else 0.0


class MetricsCollector:
    """All stages of all pipelines: windows, prometheus export, JSON snapshot, JSONL records."""

    def __init__(self, window_s: float = 10.0, records: IO[str] | None = None) -> None:
        self.window_s = window_s
        self.stages: dict[str, StageMetrics] = {}
        self.records = records
        self._records_lock = threading.Lock()
        self.registry = CollectorRegistry()
        labels = ["model", "stage", "function"]
        self.g_arrival = Gauge("quart_stage_arrival_rate", "λ_i, requests/s over the window", labels, registry=self.registry)
        self.g_service = Gauge("quart_stage_service_rate", "μ_i, requests/s of one replica", labels, registry=self.registry)
        self.g_replicas = Gauge("quart_stage_replicas", "r_i, ready replicas", labels, registry=self.registry)
        self.g_queue = Gauge("quart_stage_queue_length", "q_i, requests waiting", labels, registry=self.registry)
        self.g_wait = Gauge("quart_stage_wait_seconds", "W_i, mean queueing delay over the window", labels, registry=self.registry)
        self.g_cv = Gauge("quart_stage_arrival_cv", "CV_i of inter-arrival times", labels, registry=self.registry)
        self.g_util = Gauge("quart_stage_utilisation", "busy time / (replicas × window)", labels, registry=self.registry)
        self.c_requests = Counter("quart_pipeline_requests", "finished pipeline requests", ["model", "code"], registry=self.registry)

    def stage(self, function: str) -> StageMetrics:
        if function not in self.stages:
            self.stages[function] = StageMetrics(self.window_s)
        return self.stages[function]

    def record(self, rec: RequestRecord) -> None:
        self.c_requests.labels(rec.model, str(rec.status)).inc()
        if self.records is not None:
            with self._records_lock:
                self.records.write(rec.to_json() + "\n")

    def export(self, snapshots: list[Any]) -> None:
        """Copy PipelineSnapshots into the prometheus gauges."""
        for snap in snapshots:
            for s in snap.stages:
                lab = (snap.model, str(s.index), s.name)
                self.g_arrival.labels(*lab).set(s.arrival_rate)
                self.g_service.labels(*lab).set(s.service_rate)
                self.g_replicas.labels(*lab).set(s.replicas)
                self.g_queue.labels(*lab).set(s.queue_len)
                self.g_wait.labels(*lab).set(s.mean_wait_s)
                self.g_cv.labels(*lab).set(s.cv_arrival)
                self.g_util.labels(*lab).set(s.utilisation)

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)


def finite(x: float) -> float | None:
    """JSON-safe float (None for inf/nan)."""
    return x if math.isfinite(x) else None
